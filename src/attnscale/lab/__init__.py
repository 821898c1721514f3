"""The lab: experiments that measure each claim about the 1/sqrt(d_k) scale, and the report."""
