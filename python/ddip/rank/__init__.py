"""A rank's side: the worker loop, heal's rank half, torch.distributed's set-up, displays sent to
the kernel, and the warm rank template process that ranks are forked from. Nothing here imports
the kernel's side (ddip.kernel), the hosts' (ddip.hosts) or the launches' (ddip.launch)."""
