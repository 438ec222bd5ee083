"""Everything ``mod bench`` measures (`mixture_of_depths.bench.suite`); the last line is JSON."""

from mixture_of_depths.bench.suite import main

if __name__ == "__main__":
    main()
