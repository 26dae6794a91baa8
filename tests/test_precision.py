"""``--precision fp32|bf16|int8|auto`` (tools/test.py), eager PyTorch bf16 (``PrecisionHook``,
``Bf16Regions``), ``auto``'s measured choice, the runtimes' ``precision`` argument and the
refusals (CPUs without bf16 units: faked CPU flags; onnxruntime bf16).

The end-to-end runs use test_deploy's tiny PRepBN Swin Mask R-CNN / UperNet (2 training
iterations) and its whole-model export; the bf16 runs need a CPU with avx512_bf16 / amx_bf16
and are skipped elsewhere (the refusal is tested everywhere).
"""
import json
from types import SimpleNamespace

import pytest
import torch

from conftest import load_tool
from test_deploy import _test, load_predictions
from test_tools_e2e import demo_data, det_config, seg_config, write_config  # noqa: F401
from tool_runs import exit_message

from mmslab.utils import machine

needs_bf16 = pytest.mark.skipif(not machine.has_bf16(),
                                reason='this CPU has neither avx512_bf16 nor amx_bf16')
NO_BF16_FLAGS = ['fpu', 'avx2', 'fma', 'avx512f', 'avx512_vnni']


def logger():
    from mmengine.logging import MMLogger
    return MMLogger.get_current_instance()


def read_json(path):
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------

def test_precision_arguments_and_errors_name_the_valid_choices(tmp_path, capsys):
    tool = load_tool('test')
    base = ['cfg.py', 'ckpt.pth']
    export_dir = tmp_path / 'export'
    export_dir.mkdir()
    (export_dir / 'export.json').write_text('{}')  # parse_args checks it exists only
    backend = ['--export-dir', str(export_dir), '--backend']

    msg = exit_message(capsys, tool.parse_args, base + ['--precision', 'fp16'])
    assert "invalid choice: 'fp16'" in msg
    assert all(f"'{p}'" in msg for p in ('fp32', 'bf16', 'int8', 'auto')), msg
    for extra in (['--precision', 'int8'], ['--int8']):  # INT8 is an exported artifact
        msg = exit_message(capsys, tool.parse_args, base + extra)
        assert 'needs --backend onnxruntime or openvino' in msg
        assert 'Valid with pytorch: fp32, bf16, auto' in msg
    msg = exit_message(capsys, tool.parse_args,
                       base + backend + ['onnxruntime', '--precision', 'bf16'])
    assert 'onnxruntime has no bf16 compute on x86 CPUs' in msg and 'NOT_IMPLEMENTED' in msg
    assert 'Valid with onnxruntime: fp32, int8, auto' in msg
    msg = exit_message(capsys, tool.parse_args, base + ['--int8', '--precision', 'bf16'])
    assert 'contradicts --precision bf16' in msg
    msg = exit_message(capsys, tool.parse_args, base + ['--int8', '--bf16'])
    assert 'exclude each other' in msg

    # the short forms and the defaults
    for extra, want in (([], 'fp32'), (['--bf16'], 'bf16'), (['--precision', 'auto'], 'auto'),
                        (['--precision', 'bf16', '--bf16'], 'bf16')):
        args = tool.parse_args(base + extra)
        assert args.precision == want and args.bf16 == (want == 'bf16') and not args.int8
    args = tool.parse_args(base + backend + ['openvino', '--int8'])
    assert args.precision == 'int8' and args.int8
    args = tool.parse_args(base + backend + ['onnxruntime', '--precision', 'auto'])
    assert args.precision == 'auto'


def test_deployed_form_is_the_fastest_that_pays_for_its_precision():
    """``choose_deployment`` (``tools/export_onnx.py --latency``, ``tools/demo.sh``): the
    fastest fp32 form unless a less exact one runs at least 1.05x as fast, whatever order
    the times come in; a slower INT8 is never deployed."""
    from mmslab.deploy.runtimes import choose_deployment
    # an AVX2-only EPYC at 800x1333: OpenVINO INT8 slower than fp32, onnxruntime INT8 faster
    avx2 = {'eager fp32': 4668.0, 'onnxruntime fp32': 2581.0, 'onnxruntime int8': 1868.0,
            'openvino fp32': 2467.0, 'openvino int8': 2846.0}
    choice = choose_deployment(avx2)
    assert (choice['runtime'], choice['precision'], choice['median_ms']) == \
        ('onnxruntime', 'int8', 1868.0)
    assert choice['reason'] == ('openvino fp32 2467 ms is the fastest fp32 form; onnxruntime '
                                'int8 1868 ms runs 1.32x as fast as openvino fp32 (deployed: '
                                'the bar is 1.05x)')
    assert choose_deployment(dict(reversed(list(avx2.items())))) == choice
    # INT8 only 1.03x faster: fp32 stays; bf16 1.25x faster: bf16
    slow_int8 = {'onnxruntime fp32': 1030.0, 'openvino int8': 1000.0}
    assert choose_deployment(slow_int8)['precision'] == 'fp32'
    assert 'not deployed' in choose_deployment(slow_int8)['reason']
    bf16 = {'openvino fp32': 1000.0, 'openvino bf16': 800.0, 'openvino int8': 780.0}
    assert choose_deployment(bf16)['precision'] == 'bf16'  # INT8 1.03x bf16's speed
    assert choose_deployment(bf16, min_speedup=1.0)['precision'] == 'int8'
    # an INT8 form alone (no fp32 timed) is what there is
    assert choose_deployment({'onnxruntime int8': 5.0})['precision'] == 'int8'
    with pytest.raises(ValueError, match='no runtime form among the timed'):
        choose_deployment({'eager fp32': 1.0, 'onnxruntime bf16': 1.0})


def test_one_precision_resolver():
    """``resolve_precision`` is the one reading of ``precision`` and its short forms
    ``int8`` / ``bf16`` (``--int8`` / ``--bf16``) for the predictor, tools/test.py, the hook
    and the runtime layer; ``artifact_path`` takes a precision name, nothing else."""
    from mmslab.deploy.runtimes import (ORT_NO_BF16, RUNTIME_PRECISIONS, artifact_path,
                                        resolve_precision)
    assert resolve_precision() == 'fp32'
    assert resolve_precision(int8=True) == resolve_precision('int8') == 'int8'
    assert resolve_precision('bf16', bf16=True) == resolve_precision(bf16=True) == 'bf16'
    assert resolve_precision('auto', auto=True) == 'auto'
    assert resolve_precision('auto', runtime='onnxruntime', auto=True) == 'auto'
    for runtime, valid in RUNTIME_PRECISIONS.items():
        for precision in valid:
            assert resolve_precision(precision, runtime=runtime) == precision
    with pytest.raises(ValueError, match='valid: fp32, bf16, int8$'):
        resolve_precision('fp16')
    with pytest.raises(ValueError, match="unknown precision 'auto'; valid: fp32, bf16, int8"):
        resolve_precision('auto')  # only where a caller measures it
    with pytest.raises(ValueError, match='--int8 \\(int8=True\\) is short for --precision int8; '
                       'it contradicts --precision fp32'):
        resolve_precision('fp32', int8=True)
    with pytest.raises(ValueError, match='contradicts --precision auto'):
        resolve_precision('auto', bf16=True, auto=True)
    with pytest.raises(ValueError, match='exclude each other.*INT8 is its own precision'):
        resolve_precision(int8=True, bf16=True)
    with pytest.raises(ValueError, match='onnxruntime has no bf16.*Valid with onnxruntime: '
                       'fp32, int8$'):
        resolve_precision('bf16', runtime='onnxruntime')
    with pytest.raises(ValueError, match='Valid with onnxruntime: fp32, int8, auto'):
        resolve_precision(bf16=True, runtime='onnxruntime', auto=True)
    with pytest.raises(ValueError, match="unknown runtime 'tensorrt'"):
        resolve_precision('fp32', runtime='tensorrt')

    assert artifact_path('d', 'openvino', 'int8') == 'd/openvino/model_int8.xml'
    assert artifact_path('d', 'openvino', 'bf16') == artifact_path('d', 'openvino', 'fp32') \
        == 'd/openvino/model.xml'
    assert artifact_path('d', 'onnxruntime', 'int8') == 'd/model_int8.onnx'
    with pytest.raises(ValueError, match='unknown precision True'):
        artifact_path('d', 'openvino', True)  # a flag is not a precision
    assert 'mlas.enable_gemm_fastmath_arm64_bfloat16' in ORT_NO_BF16


# ----------------------------------------------------------------------------------------------
# refusal on CPUs without bf16 units (faked CPU flags)
# ----------------------------------------------------------------------------------------------

def test_bf16_refused_on_a_cpu_without_bf16(monkeypatch, capsys, tmp_path):
    from mmengine.config import Config

    from mmslab.engine.hooks import PrecisionHook
    monkeypatch.setattr(machine, 'cpu_flags', lambda: list(NO_BF16_FLAGS))
    assert not machine.has_bf16()
    tool = load_tool('test')
    for extra, what in (([], 'eager PyTorch bf16'), (['--backend', 'openvino'], 'openvino bf16')):
        export_dir = tmp_path / 'export'
        export_dir.mkdir(exist_ok=True)
        (export_dir / 'export.json').write_text('{}')
        args = tool.parse_args(['cfg.py', 'ckpt.pth', '--precision', 'bf16'] + extra +
                               (['--export-dir', str(export_dir)] if extra else []))
        msg = exit_message(capsys, tool.setup_precision, Config(dict(custom_hooks=[])), args)
        assert f'{what}: bf16 needs a CPU with avx512_bf16 or amx_bf16' in msg, msg
    with pytest.raises(RuntimeError, match='avx512_bf16 or amx_bf16'):
        PrecisionHook('bf16')

    # auto on such a CPU: fp32, nothing timed, the model untouched
    hook = PrecisionHook('auto')
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    hook.before_test_epoch(SimpleNamespace(model=model, logger=logger()))
    assert hook.result['precision'] == 'fp32'
    record = hook.result['auto']
    assert record['candidates'] == ['fp32'] and record['times_ms'] == {}
    assert 'neither avx512_bf16 nor amx_bf16' in record['reason']
    assert 'forward' not in vars(model)
    hook.after_test_epoch(None)


def test_precision_and_a_reparam_hook_precision_exclude_each_other(monkeypatch, capsys):
    """tools/test.py --precision bf16 with a config whose ReparamEvalHook already autocasts:
    refused before anything is built (both would set autocast regions on the fused copy);
    AutocastRegions refuses the nesting too."""
    from mmengine.config import Config

    from mmslab.utils.precision import AutocastRegions, Bf16Regions
    monkeypatch.setattr(machine, 'cpu_flags', lambda: NO_BF16_FLAGS + ['amx_bf16'])
    tool = load_tool('test')
    args = tool.parse_args(['cfg.py', 'ckpt.pth', '--precision', 'bf16'])
    cfg = Config(dict(custom_hooks=[dict(type='ReparamEvalHook', precision='fp16')]))
    msg = exit_message(capsys, tool.setup_precision, cfg, args)
    assert "--precision bf16 and the config's ReparamEvalHook(precision='fp16') exclude" in msg
    cfg = Config(dict(custom_hooks=[dict(type='ReparamEvalHook', precision='fp32')]))
    tool.setup_precision(cfg, args)
    assert [h['type'] for h in cfg.custom_hooks] == ['ReparamEvalHook', 'PrecisionHook']

    model = _TinyDetector()
    regions = AutocastRegions(model, torch.float16)
    assert AutocastRegions.of(model) is regions and regions.precision == 'fp16'
    with pytest.raises(RuntimeError, match=r'already runs its network parts under autocast '
                       r'\(fp16\)'):
        Bf16Regions(model)
    regions.remove()
    assert AutocastRegions.of(model) is None and 'predict' not in vars(model)
    regions = Bf16Regions(model, enabled=False)
    assert regions.precision == 'fp32' and not regions.enabled
    regions.enabled = True
    assert regions.dtype == torch.bfloat16 and regions.precision == 'bf16'
    regions.remove()


class _TinyDetector(torch.nn.Module):
    """A backbone and a head, and the ``predict`` autocast regions wrap."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Linear(2, 2)
        self.head = torch.nn.Linear(2, 2)

    def predict(self, x):
        return self.head(self.backbone(x))


def test_predictor_precision_without_torch_errors(monkeypatch, tmp_path):
    """The torch-free predictor reads its precision through the one resolver and turns its
    refusals into a PredictError (its runs: test_predict_without_torch); OpenVINO bf16 on a
    CPU without bf16 units is refused before the model is read."""
    from mmslab.deploy.predict import PredictError, Predictor
    from mmslab.deploy.runtimes import OpenVINOModel
    with pytest.raises(PredictError, match='onnxruntime has no bf16'):
        Predictor(str(tmp_path), 'onnxruntime', precision='bf16')
    with pytest.raises(PredictError, match='contradicts --precision bf16'):
        Predictor(str(tmp_path), 'openvino', int8=True, precision='bf16')
    with pytest.raises(PredictError, match="unknown runtime 'tensorrt'"):
        Predictor(str(tmp_path), 'tensorrt')
    monkeypatch.setattr(machine, 'cpu_flags', lambda: list(NO_BF16_FLAGS))
    with pytest.raises(RuntimeError, match='avx512_bf16 or amx_bf16'):
        OpenVINOModel(str(tmp_path / 'not_read.xml'), bf16=True)


# ----------------------------------------------------------------------------------------------
# eager bf16: which parts, float32 outside them
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('task', ['det', 'seg'])
def test_bf16_regions_cover_the_network_and_hand_back_float32(task, tmp_path):
    """Backbone, neck and heads (the RoI heads' box and mask heads, not their parameter-free
    RoI extractors) run in bf16 inside ``predict`` only, with float32 outputs; outside
    ``predict`` (ReparamEvalHook's check) and after ``remove`` nothing changes."""
    from mmslab.utils.launch import build_model_from_config
    from mmslab.utils.precision import Bf16Regions, network_parts
    make = det_config if task == 'det' else seg_config
    config = write_config(tmp_path / f'{task}.py', make(str(tmp_path), tmp_path / 'wd'))
    _, model = build_model_from_config(config)
    model.eval()
    names = {id(m): n for n, m in model.named_modules()}
    parts = [names[id(m)] for m in network_parts(model)]
    if task == 'det':
        assert parts == ['backbone', 'neck', 'rpn_head', 'roi_head.bbox_head',
                         'roi_head.mask_head']
    else:
        assert parts == ['backbone', 'decode_head']

    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        ref = model.extract_feat(x)
    seen = []  # the dtype of the backbone's first convolution (inside the wrapped forward)
    conv = next(m for m in model.backbone.modules() if isinstance(m, torch.nn.Conv2d))
    conv.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    regions = Bf16Regions(model)
    assert regions.num_parts == len(parts)
    with torch.no_grad():
        out = model.extract_feat(x)  # outside predict: fp32, unchanged
        assert all(torch.equal(a, b) for a, b in zip(ref, out))
        regions._active += 1  # as inside predict
        try:
            low = model.extract_feat(x)
        finally:
            regions._active -= 1
    assert seen == [torch.float32, torch.bfloat16]  # the backbone computed in bf16 ...
    assert all(t.dtype == torch.float32 for t in low)  # ... and handed back float32
    diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(low, ref))
    assert 0 < diff < 0.1, diff
    regions.enabled = False
    with torch.no_grad():
        regions._active += 1
        assert all(torch.equal(a, b) for a, b in zip(ref, model.extract_feat(x)))
        regions._active -= 1
    regions.remove()
    assert not any('forward' in vars(m) for m in model.modules())
    assert 'predict' not in vars(model)


# ----------------------------------------------------------------------------------------------
# tools/test.py --precision bf16 / auto on the tiny models
# ----------------------------------------------------------------------------------------------

def _run(run, tmp_path, name, *extra):
    metrics, output, out = _test(run, tmp_path, name, *extra)
    wd = tmp_path / f'wd_{name}'
    assert read_json(wd / 'metrics.json') == metrics
    return metrics, output, out, read_json(wd / 'latency.json')


@needs_bf16
@pytest.mark.slow  # trains, then tools/test.py twice
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_eager_bf16_metrics_close_to_fp32(tiny, tmp_path, task, monkeypatch):  # noqa: F811
    """bf16 through tools/test.py: the same detections (label maps) as fp32 up to bf16
    rounding, metrics within bounds; but not bit-identical (bf16 really ran). The
    fused-vs-unfused check still runs in float32."""
    # one window softmax form in both runs: 'auto' picks by timing, and the two forms round
    # differently, which moves the fp32 check's figure by more than its tolerance
    monkeypatch.setenv('MMSLAB_WINDOW_SOFTMAX', 'matmul')
    run = tiny(task)
    ref, _, ref_out, ref_latency = _run(run, tmp_path, 'fp32')
    got, output, got_out, latency = _run(run, tmp_path, 'bf16', '--precision', 'bf16',
                                         '--latency')
    assert got['precision'] == 'bf16' and got['bf16'] is True and ref['precision'] == 'fp32'
    assert 'evaluated in bf16 (torch.autocast on' in output
    # --latency timed the fused and (in the same precision) the unfused model in bf16
    assert latency['precision'] == 'bf16' and ref_latency['precision'] == 'fp32'
    assert latency['device'] == 'cpu' and latency['unfused']['count'] > 0
    assert latency['max_relative_difference'] == pytest.approx(
        ref_latency['max_relative_difference'], rel=1e-3, abs=1e-7)  # fp32 check, unchanged
    assert latency['max_relative_difference'] < 1e-3
    if task == 'det':
        from mmslab.deploy.compare import compare_detections
        for key in ('coco/bbox_mAP', 'coco/bbox_mAP_50', 'coco/segm_mAP'):
            assert got[key] == pytest.approx(ref[key], abs=0.01), key
        worst_score = 0.0
        for a, b in zip(load_predictions(ref_out), load_predictions(got_out)):
            assert b['bboxes'].dtype == b['scores'].dtype == torch.float32
            rec = compare_detections(
                dict(dets=torch.cat([a['bboxes'], a['scores'][:, None]], 1).numpy(),
                     labels=a['labels'].numpy()),
                dict(dets=torch.cat([b['bboxes'], b['scores'][:, None]], 1).numpy(),
                     labels=b['labels'].numpy()))
            assert rec['num_ref'] == rec['num_out'] > 0, rec
            assert rec['matched'] >= 0.85 and rec['mean_iou'] > 0.99, rec
            assert rec['max_box_px'] <= 0.5 and rec['max_score'] <= 5e-3, rec
            worst_score = max(worst_score, rec['max_score'])
        assert worst_score > 0  # bf16 rounding is visible: the autocast was not a no-op
    else:
        import mmcv
        for key in ('mIoU', 'aAcc'):
            assert got[key] == pytest.approx(ref[key], abs=0.5), key
        names = sorted(p.name for p in ref_out.iterdir())
        assert names and names == sorted(p.name for p in got_out.iterdir())
        changed = []
        for name in names:
            a = mmcv.imread(str(ref_out / name), 'unchanged')
            b = mmcv.imread(str(got_out / name), 'unchanged')
            changed.append((a != b).mean())
        # the 2-iteration model's logits are near ties: bf16 flips ~1 % of the pixels
        assert max(changed) < 0.05 and sum(changed) > 0, changed


@pytest.mark.slow  # trains, then tools/test.py
def test_auto_writes_its_measured_choice(tiny, tmp_path):  # noqa: F811
    run = tiny('det')
    metrics, output, _, latency = _run(run, tmp_path, 'auto', '--precision', 'auto')
    record = metrics['precision_auto']
    assert metrics['precision_requested'] == 'auto'
    assert metrics['precision'] == record['choice'] and 'auto chose' in output
    assert latency['images'] == 4  # auto's timing runs are not counted as test images
    if not machine.has_bf16():
        assert record['candidates'] == ['fp32'] and record['choice'] == 'fp32'
        return
    assert record['candidates'] == ['fp32', 'bf16'] and record['repeat'] >= 1
    times = record['times_ms']
    assert set(times) == {'fp32', 'bf16'} and min(times.values()) > 0
    faster = times['bf16'] * record['margin'] < times['fp32']
    assert record['choice'] == ('bf16' if faster else 'fp32'), record
    assert metrics['bf16'] is (record['choice'] == 'bf16')
    assert ('evaluated in bf16' in output) is (record['choice'] == 'bf16')


@pytest.mark.slow  # trains, exports, then tools/test.py --backend
def test_runtime_auto_and_bf16(exported, tmp_path):  # noqa: F811
    """OpenVINO ``--precision auto``: fp32 against bf16 (CPUs with bf16 units) on the first
    test image, the choice in metrics.json; onnxruntime auto: fp32 without timing;
    ``precision='bf16'`` loads as ``bf16=True`` did."""
    from mmslab.deploy.runtimes import load_runtime_model
    from mmslab.engine.hooks import RuntimeBackendHook
    ex = exported('det')
    metrics, output, _ = _test(ex, tmp_path, 'ov_auto', '--backend', 'openvino',
                               '--precision', 'auto', '--export-dir', ex['export_dir'])
    record = metrics['precision_auto']
    assert metrics['precision'] == record['choice']
    assert f"runs in openvino ({record['choice']}," in output
    deviation = ex['report']['runtimes']['openvino'].get('bf16_on_test_images')
    assert (deviation is not None) is machine.has_bf16()  # tools/export_onnx.py records it
    if machine.has_bf16():
        assert len(deviation) >= 5 and all(r['mean_iou'] > 0.8 for r in deviation.values()
                                           if r['num_ref']), deviation
        times = record['times_ms']
        assert set(times) == {'fp32', 'bf16'}
        faster = times['bf16'] * record['margin'] < times['fp32']
        assert record['choice'] == ('bf16' if faster else 'fp32')
        assert 'first test image' in record['what']
        assert load_runtime_model(ex['export_dir'], 'openvino',
                                  precision='bf16').precision == 'bf16'

    hook = RuntimeBackendHook(ex['export_dir'], 'onnxruntime', precision='auto')
    hook._choose_precision(SimpleNamespace(logger=logger()), None)
    assert hook.precision == 'fp32' and hook.auto_record['candidates'] == ['fp32']
    assert 'onnxruntime has no bf16' in hook.auto_record['reason']
    with pytest.raises(ValueError, match='onnxruntime has no bf16'):
        RuntimeBackendHook(ex['export_dir'], 'onnxruntime', precision='bf16')
    assert RuntimeBackendHook(ex['export_dir'], 'openvino', int8=True).precision == 'int8'
