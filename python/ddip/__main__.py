"""`python -m ddip run ...` is `ddip run ...`."""

from .cli import main

main()
