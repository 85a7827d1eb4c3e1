"""The notebook's side (the Jupyter kernel): `Group` and the runtime under it, requests and their
wait policy, heal's kernel half, the kernel's handle on the warm rank template, and showing
ranks' displays."""

from .. import _lazy

__getattr__ = _lazy.submodules(__name__)  # ddip.kernel.<module> reached after `import ddip`
