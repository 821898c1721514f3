import numpy as np
import torch

import attnscale
from attnscale import reference


def test_default_scale_matches_reference_and_torch():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    out = attnscale.scaled_dot_product_attention(q, k, v)
    expected = reference.attention(q.numpy(), k.numpy(), v.numpy())
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), rtol=0, atol=1e-12)
