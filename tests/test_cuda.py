"""The backbones on a CUDA GPU: skipped without one (CI has none); run on a GPU machine with
``python -m pytest tests/test_cuda.py`` (``tools/gpu_check.sh`` runs it first).

References are independent of the code under test where one exists: mmdet's Swin for the
LayerNorm build, the quadratic-order SLA formula for linear attention, the CPU for the
device-independent parts. TF32 is off so that fp32 means fp32.
"""
import os

import pytest
import torch
import torch.nn as nn

import mmslab
from conftest import randomize_bn_statistics, rel_err
from presets import SWIN_TINY, build_preset
from mmslab.engine.hooks import set_progressive_iter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
CUDA = torch.device('cuda')


def _tf32_settings():
    """The TF32 settings of cuDNN convolutions and CUDA matmuls: the per-backend
    ``fp32_precision`` where this torch has it (mixing it with the legacy flags is an
    error), else the legacy ``allow_tf32`` flags. Returns ``(objects, attribute, on, off)``."""
    backends = torch.backends
    objs = (backends.cudnn.conv, backends.cuda.matmul)
    if hasattr(backends.cudnn.conv, 'fp32_precision'):
        return objs, 'fp32_precision', 'tf32', 'ieee'
    return (backends.cudnn, backends.cuda.matmul), 'allow_tf32', True, False


def set_tf32(on: bool) -> tuple:
    """Turn TF32 on or off in cuDNN convolutions and CUDA matmuls; returns the settings."""
    objs, attr, yes, no = _tf32_settings()
    for obj in objs:
        setattr(obj, attr, yes if on else no)
    return tuple(getattr(obj, attr) for obj in objs)


@pytest.fixture(autouse=True)
def no_tf32():
    objs, attr, _, _ = _tf32_settings()
    saved = [getattr(obj, attr) for obj in objs]
    set_tf32(False)
    yield
    for obj, value in zip(objs, saved):
        setattr(obj, attr, value)


def test_layernorm_build_equals_mmdet_swin_on_cuda():
    from mmdet.models.backbones import SwinTransformer
    torch.manual_seed(0)
    ref = SwinTransformer(**SWIN_TINY, out_indices=(0, 1, 2, 3))
    ref.init_weights()
    ref.to(CUDA)
    ref.eval()  # mmdet's Swin.train() returns None: no chaining
    ours = mmslab.models.ReparamSwinTransformer(**SWIN_TINY, norm_cfg=dict(type='LN'))
    ours.load_state_dict(ref.state_dict(), strict=True)
    ours = ours.to(CUDA).eval()
    for hw in [(64, 64), (70, 90)]:
        x = torch.randn(1, 3, *hw, device=CUDA)
        with torch.no_grad():
            for a, b in zip(ref(x), ours(x)):
                assert rel_err(b, a) <= 1e-5, hw


@pytest.mark.parametrize('name', ['PRepBNSwin', 'SLABSwin', 'RePaSwin'])
def test_amp_training_and_exact_fusion_on_cuda(name):
    """fp16 autocast training steps with a loss scaler on CUDA give finite losses and are
    applied once the scale settles; then fused == unfused in fp32 on CUDA, the CUDA outputs
    equal the CPU's, and the fused model under fp16 autocast stays close to fp32."""
    torch.manual_seed(0)
    model = build_preset(name)
    model.init_weights()
    model = model.to(CUDA).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler('cuda')
    applied = 0
    for it in range(8):
        set_progressive_iter(model, it)
        with torch.autocast('cuda', dtype=torch.float16):
            outs = model(torch.randn(2, 3, 64, 72, device=CUDA))
            loss = sum(o.float().square().mean() for o in outs)
        assert torch.isfinite(loss)
        opt.zero_grad()
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        applied += scaler.get_scale() >= scale  # a skipped (overflowing) step halves the scale
    # overflow is the loss scaler's start-up (65536 is too large), not a NaN in the fp16 path:
    # once the scale has settled, steps are applied
    assert applied >= 4, f'only {applied} of 8 fp16 steps applied'
    model.cpu()
    randomize_bn_statistics(model)  # seeded on the CPU
    model.to(CUDA)
    model.eval()
    x = torch.randn(2, 3, 61, 83, device=CUDA)
    with torch.no_grad():
        ref = [o.clone() for o in model(x)]
        mmslab.reparameterize(model)
        fused = model(x)
        with torch.autocast('cuda', dtype=torch.float16):
            half = model(x)
        on_cpu = model.cpu()(x.cpu())  # size caches and buffers follow the device
        model.to(CUDA)
        back = model(x)
    for r, f, h, c, b in zip(ref, fused, half, on_cpu, back):
        assert f.device.type == 'cuda'
        assert rel_err(f, r) <= 1e-4
        assert rel_err(c, f.cpu()) <= 1e-4
        assert torch.equal(b, f)
        assert rel_err(h.float(), f) <= 2e-2


def test_sla_matches_the_quadratic_formula_on_cuda():
    from test_layers import naive_sla
    from mmslab.models.layers import SLA
    torch.manual_seed(3)
    sla = SLA(16, 2, 4).double()
    nn.init.normal_(sla.positional_encoding, std=0.5)
    sla = sla.to(CUDA)
    qkv = torch.randn(3, 16, 48, dtype=torch.float64, device=CUDA)
    out = sla.attend(qkv, (4, 4))
    for b in range(3):
        ref = naive_sla(qkv[b], sla.positional_encoding[0], sla.dwc, 2, (4, 4))
        assert rel_err(out[b], ref) <= 1e-10


@pytest.mark.parametrize('grad', [False, True])
def test_sla_windows_of_a_padded_map_match_the_formula_on_cuda(grad):
    """Eager SLA on a map its shifted windows do not tile (the cropped groups), in inference
    and training, against the padded-window formula on the CPU in float64."""
    from test_layers import shifted_sla_reference
    from mmslab.models.layers import ShiftWindowAttention
    torch.manual_seed(7)
    attn = ShiftWindowAttention(16, 2, 8, shift=True, attn_type='sla').double().eval()
    nn.init.normal_(attn.w_msa.positional_encoding, std=0.5)
    nn.init.normal_(attn.w_msa.dwc.weight, std=0.5)
    hw = (23, 31)
    x = torch.randn(2, hw[0] * hw[1], 16, dtype=torch.float64)
    ref = [shifted_sla_reference(attn, x[b], hw) for b in range(2)]
    attn = attn.to(CUDA)
    with torch.set_grad_enabled(grad):
        out = attn(x.to(CUDA), hw).detach().cpu()
    for b in range(2):
        assert rel_err(out[b], ref[b]) <= 1e-10


def _swin(name):
    """A fused tiny preset, or mmdet's Swin (as the benchmark times it), on CUDA."""
    torch.manual_seed(0)
    if name == 'mmdet':
        from mmdet.models.backbones import SwinTransformer
        model = SwinTransformer(**SWIN_TINY, out_indices=(0, 1, 2, 3))
        model.init_weights()
    else:
        model = build_preset(name)
        model.init_weights()
        randomize_bn_statistics(model)
        mmslab.reparameterize(model.eval())
    model.to(CUDA)
    model.eval()
    return model


@pytest.mark.parametrize('name', ['SLABSwin', 'PRepBNSwin', 'RePaSwin', 'mmdet'])
def test_cuda_graph_replay_equals_the_eager_forward(name):
    """A backbone replayed from CUDA graphs gives its eager outputs, in fp32 and under fp16
    autocast, at maps its windows tile and maps they do not, coming back to a shape it
    captured before; returned outputs survive the next replay; an in-place weight update
    (as load_state_dict or an optimizer makes) is seen: the graphs are captured anew."""
    from mmslab.deploy.cuda_graph import CUDAGraphModule
    model = _swin(name)
    graphed = CUDAGraphModule(model)
    shapes = [(64, 72), (61, 83), (64, 72)]
    with torch.inference_mode():
        for hw in shapes:
            for half in (False, True):
                x = torch.randn(1, 3, *hw, device=CUDA)
                with torch.autocast('cuda', dtype=torch.float16, enabled=half):
                    got = graphed(x)
                    ref = [o.float() for o in model(x)]
                    kept = [o.clone() for o in got]
                    graphed(torch.randn_like(x))  # the same graph, other inputs
                for r, g, k in zip(ref, got, kept):
                    assert rel_err(g.float(), r) <= (2e-3 if half else 1e-6), (hw, half)
                    assert torch.equal(g, k)
        assert graphed.captures == 4  # two shapes x two precisions, reused on the way back
        x = torch.randn(1, 3, 64, 72, device=CUDA)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        ref = model(x)
        got = graphed(x)
    assert graphed.captures == 5
    for r, g in zip(ref, got):
        assert rel_err(g, r) <= 1e-6


def test_cuda_graphs_in_a_detector_predict_as_eager():
    """The demo SLAB-Swin-T Mask R-CNN, fused, with its backbone and neck replayed from CUDA
    graphs (use_cuda_graphs): the same features and detections as eager, at two sizes."""
    from mmslab.benchmark import fake_batch
    from mmslab.deploy.cuda_graph import graph_captures, release_cuda_graphs, use_cuda_graphs
    from mmslab.utils.launch import build_model_from_config
    torch.manual_seed(0)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _, model = build_model_from_config(
        os.path.join(root, 'configs', 'demo', 'mask_rcnn_slab_swin_t_demo.py'))
    model.init_weights()
    randomize_bn_statistics(model)
    mmslab.reparameterize(model.eval())
    model.to(CUDA)
    keys = list(model.state_dict())
    for hw in [(320, 480), (480, 352)]:
        inputs, samples = fake_batch(model, hw)
        with torch.no_grad():
            use_cuda_graphs(model)
            feats = model.extract_feat(inputs)
            got = model(inputs, samples, mode='predict')[0].pred_instances
            release_cuda_graphs(model)
            ref_feats = [f.clone() for f in model.extract_feat(inputs)]
            ref = model(inputs, samples, mode='predict')[0].pred_instances
        for r, f in zip(ref_feats, feats):
            assert rel_err(f, r) <= 1e-6, hw
        assert len(got) == len(ref), hw
        assert torch.allclose(got.bboxes, ref.bboxes, atol=1e-3), hw
        assert torch.allclose(got.scores, ref.scores, atol=1e-5), hw
    assert graph_captures(model) is None and list(model.state_dict()) == keys


@pytest.mark.parametrize('config', ['configs/mask_rcnn_slab_swin_t_1x.py',
                                    'configs/mask_rcnn_prepbn_swin_t_1x.py'])
def test_the_fusion_check_passes_with_tf32_on_cuda(config):
    """The real config at its training input size, random weights, BatchNorm statistics
    away from their defaults, TF32 on (PyTorch's default for cuDNN convolutions on Ampere
    and newer GPUs, where the SLAB-Swin-T Mask R-CNN's first validation failed the check
    with 1.04e-3): the check computes in IEEE float32 and passes well inside its tolerance,
    although the same comparison under TF32 moves by the size of a wrong fold; the TF32
    settings are as they were afterwards. A wrong fold is still caught there."""
    import copy
    import os.path as osp
    from conftest import wrong_fold
    from mmslab.engine.hooks.reparam_eval_hook import (comparable_outputs, fusion_difference,
                                                       max_relative_difference)
    from mmslab.utils.launch import load_config, model_registry
    cfg, scope = load_config(osp.join(osp.dirname(osp.dirname(__file__)), config))
    cfg.model.backbone.init_cfg = None
    torch.manual_seed(0)
    model = model_registry(scope).build(cfg.model)
    model.init_weights()
    randomize_bn_statistics(model)
    model = model.to(CUDA).eval()
    fused = mmslab.reparameterize(copy.deepcopy(model))
    # a smooth image with noise, normalized as the data preprocessor would
    g = torch.Generator().manual_seed(0)
    image = torch.nn.functional.interpolate(torch.rand(1, 3, 25, 38, generator=g), (800, 1216),
                                            mode='bilinear') + 0.05 * torch.randn(
                                                1, 3, 800, 1216, generator=g)
    data = dict(inputs=((image - 0.45) / 0.25).to(CUDA))
    tf32 = set_tf32(True)
    with torch.no_grad():
        under_tf32 = max_relative_difference(comparable_outputs(model, data),
                                             comparable_outputs(fused, data))
    diff, where = fusion_difference(model, fused, data, tolerance=1e-3)
    assert set_tf32(True) == tf32  # the check restored them
    assert under_tf32 > 1e-4, 'TF32 was not in effect: the test proves nothing'
    assert diff < 1e-4 and where is None, (diff, under_tf32)
    broken = wrong_fold(lambda m: m, stage=3, factor=1.01)(copy.deepcopy(fused))
    diff_broken, where = fusion_difference(model, broken, data, tolerance=1e-3)
    assert diff_broken > 1e-3 and where is not None and 'stages.3' in where[0]
