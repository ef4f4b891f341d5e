"""`python -m sailor ...`: the same command line as the `sailor` console script."""

from sailor.cli import main

if __name__ == "__main__":
    main()
