"""`python -m ddip.remote`, kept as a public path: it is the command line every launcher (ssh,
srun, a launcher command) runs on another host (cpp/ddip/plan.cpp). The agent is ddip.hosts.agent."""

import sys

from .hosts.agent import host_spec, main

__all__ = ["host_spec", "main"]

if __name__ == "__main__":
    sys.exit(main())
