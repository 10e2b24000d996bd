"""``python -m tf_commstrategy.run -np N COMMAND ...``: the same as ``tfcs-run``."""

from .launcher.run import main

if __name__ == "__main__":
    main()
