"""One module per claim; each exposes CLAIM, Config, run, judge and plot (see ``attnscale.lab.base``)."""
