"""``python -m xffl_like.bench``: the aggregation benchmark (see :mod:`xffl_like.bench.aggregation`)."""

from .aggregation import main

if __name__ == "__main__":
    main()
