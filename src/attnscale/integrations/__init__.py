"""Optional bridges from the monitor to training tools; each submodule imports its tool only when used.

* :mod:`attnscale.integrations.trainer` - a transformers ``Trainer`` callback (``pip install 'attnscale[trainer]'``);
* :mod:`attnscale.integrations.tensorboard` - a TensorBoard writer (``pip install 'attnscale[tensorboard]'``).
"""
