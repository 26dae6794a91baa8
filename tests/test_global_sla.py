"""SLAB-PVT's global SLA resizes its learned positional encoding to any other grid."""
import torch
import torch.nn.functional as F

from mmslab.models.backbones.pvt import GlobalSLA


def test_smaller_and_larger_grids_use_the_bilinearly_resized_encoding():
    torch.manual_seed(0)
    attn = GlobalSLA(16, 2, grid=(8, 8)).eval()
    torch.nn.init.normal_(attn.kernel.positional_encoding, std=0.5)
    for grid in [(4, 6), (12, 10)]:
        # reference: the same module with the encoding resized by hand to this grid
        ref = GlobalSLA(16, 2, grid=grid).eval()
        ref.load_state_dict({k: v for k, v in attn.state_dict().items()
                             if 'positional_encoding' not in k}, strict=False)
        pos = attn.kernel.positional_encoding.detach().view(1, 8, 8, 16).permute(0, 3, 1, 2)
        pos = F.interpolate(pos, size=grid, mode='bilinear', align_corners=False)
        ref.kernel.positional_encoding.data.copy_(pos.flatten(2).transpose(1, 2))
        x = torch.randn(2, grid[0] * grid[1], 16)
        with torch.no_grad():
            torch.testing.assert_close(attn(x, grid), ref(x, grid), rtol=1e-5, atol=1e-6)
