"""Benchmarks: MoD against its dense twin, side by side in one run (`mod bench`).

`suite` is the whole comparison (training step over capacities and lengths, one block, peak
memory, decoding, eager against compiled); `decode` is the decode benchmark it calls. The
scripts in ``benchmarks/`` are thin wrappers around these modules.
"""
