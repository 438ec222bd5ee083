"""Decode tokens/s and KV-cache bytes, MoD against its dense twin: see
`mixture_of_depths.bench.decode` (``python benchmarks/decode.py --help``)."""

from mixture_of_depths.bench.decode import main

if __name__ == "__main__":
    main()
