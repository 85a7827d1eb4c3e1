"""Integrations with training libraries: what each needs to train distributed in ddip's ranks.

    ddip.apps.fastai    %makedip -a fastai, or ranch(..., ctx=ddip.apps.fastai.ctx())
"""

from .. import _lazy

__getattr__ = _lazy.submodules(__name__)  # ddip.apps.<module> reached after `import ddip`
