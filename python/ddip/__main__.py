"""`python -m ddip run ...` is `ddip run ...`."""

from .launch.program import main

main()
