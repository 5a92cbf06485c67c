"""`python -m ggtrain` runs the command line (layer 0)."""
from ggtrain.cli.main import main

if __name__ == "__main__":
    main()
