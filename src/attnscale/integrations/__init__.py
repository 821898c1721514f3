"""Optional bridges from the monitor to training tools; each submodule imports its tool only when used.

* :mod:`attnscale.integrations.trainer` - a transformers ``Trainer`` callback (``pip install 'attnscale[trainer]'``);
* :mod:`attnscale.integrations.tensorboard` - a TensorBoard writer (``pip install 'attnscale[tensorboard]'``);
* :mod:`attnscale.integrations.hf_autoregister` - registers ``attn_implementation="attnscale"`` with
  transformers when its modeling code is imported (``import attnscale`` installs it; it imports nothing).
"""
