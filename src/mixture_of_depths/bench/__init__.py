"""Benchmarks: MoD against its dense twin, side by side in one run (`mod bench`).

`suite` is the whole comparison: its flags and its run. It measures with `sections` (training
step over capacities and lengths, one block, peak memory through `memory`'s fresh processes,
decoding through `decode`, eager against compiled, a profile) and `moe` (expert layers and
MoDE), and prints with `report`; `common` holds the timing and formatting they share. `decode`
is also a benchmark of its own. The scripts in ``benchmarks/`` are thin wrappers around these
modules.
"""
