"""``python -m mmslab.deploy.predict``: the deployed predictor, run where PyTorch and OpenMMLab
cannot be imported.

The export directories are built here without torch: tiny ONNX graphs (``onnx.helper``) whose
outputs are constants plus a term of the input (``ReduceMean``), and an ``export.json`` as
``tools/export_onnx.py --part model`` writes it. The predictor runs in a subprocess whose
``PYTHONPATH`` starts with packages ``torch``, ``mmcv``, ``mmdet``, ``mmengine`` and ``mmseg``
that raise ``ModuleNotFoundError`` (as packages that are not installed), and must run
without a warning. Images: crops of matplotlib's sample photograph, one portrait, one
landscape (transposed), of different sizes, so the two resize factors differ per axis.

Expected results are computed here from the formulas (mmcv's ``rescale_size``, box / scale
factor, clipping), not from the predictor's functions. With torch and mmdet present, the
mask pasting and the bilinear resizing are also compared with mmdet's / PyTorch's own.
"""
import importlib.util
import json
import os
import os.path as osp
import shutil
import subprocess
import sys

import cv2
import numpy as np
import onnx
import onnxruntime  # noqa: F401 (a requirement of the suite: a broken install fails here)
import openvino as ov
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import REPO

BLOCKED = ('torch', 'mmcv', 'mmdet', 'mmengine', 'mmseg')
CLASSES = ['person', 'bicycle', 'car']
SEG_CLASSES = ['sky', 'left', 'right', 'padding']
MEAN, STD = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]

# detections in the network input's pixel frame: x1, y1, x2, y2, score; third under 0.3
DETS = np.array([[10, 20, 150, 250, 0.95],
                 [130.5, 30.25, 190, 120, 0.6],  # the left half sticks out of the first
                 [5, 5, 50, 50, 0.1]], np.float32)
LABELS = np.array([1, 2, 0], np.int64)
DET_SCALE = [320, 192]  # keep_ratio: long side <= 320, short side <= 192
SEG_SCALE, SEG_SIZE = [256, 192], [224, 288]  # resize to 256x192 (w, h), pad to 224x288


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# ----------------------------------------------------------------------------------------------
# exports, images, running the predictor
# ----------------------------------------------------------------------------------------------

def det_masks() -> np.ndarray:
    """RoI probabilities: 0.9 everywhere; the left half of the RoI only; 1 everywhere."""
    masks = np.zeros((3, 28, 28), np.float32)
    masks[0] = 0.9
    masks[1, :, :14] = 1.0
    masks[2] = 1.0
    return masks


def seg_logits() -> np.ndarray:
    """``[1, 4, 56, 72]`` logits at stride 4 of the padded 224x288 input: class 1 left of
    x = 128, class 2 right of it, class 3 on the padding (y >= 192 or x >= 256), 0 nowhere.
    Without the crop of the padding, class 3 would cover the bottom and right of the image."""
    logits = np.zeros((1, 4, 56, 72), np.float32)
    logits[0, 1, :48, :32] = 10
    logits[0, 2, :48, 32:64] = 10
    # lower, so that bilinear weights from the padding (<= 0.61 at the corner) never win
    logits[0, 3, 48:, :] = 4
    logits[0, 3, :, 64:] = 4
    return logits


def make_graph(outputs: dict, input_shape, argmax: bool = False) -> onnx.ModelProto:
    """``out = const + 0 * mean(input)`` for float outputs (``const + mean(input)`` for
    logits: the same shift for every class, argmax unchanged), ``Identity`` for integers;
    with ``argmax`` the logits become ``seg_label``."""
    nodes = [helper.make_node('ReduceMean', ['input'], ['mean'], keepdims=0),
             helper.make_node('Mul', ['mean', 'zero'], ['no_shift'])]
    inits = [numpy_helper.from_array(np.zeros((), np.float32), 'zero')]
    graph_outputs = []
    for name, value in outputs.items():
        inits.append(numpy_helper.from_array(value, f'{name}_const'))
        if value.dtype == np.int64:
            nodes.append(helper.make_node('Identity', [f'{name}_const'], [name]))
        elif name == 'seg_logits':
            out = 'logits' if argmax else name
            nodes.append(helper.make_node('Add', [f'{name}_const', 'mean'], [out]))
            if argmax:
                name, value = 'seg_label', np.zeros(value.shape[:1] + value.shape[2:], np.int64)
                nodes.append(helper.make_node('ArgMax', ['logits'], [name], axis=1,
                                              keepdims=0))
        else:
            nodes.append(helper.make_node('Add', [f'{name}_const', 'no_shift'], [name]))
        dtype = TensorProto.INT64 if value.dtype == np.int64 else TensorProto.FLOAT
        graph_outputs.append(helper.make_tensor_value_info(name, dtype, list(value.shape)))
    graph = helper.make_graph(
        nodes, 'tiny', [helper.make_tensor_value_info('input', TensorProto.FLOAT, input_shape)],
        graph_outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 17)])
    onnx.checker.check_model(model)
    return model


def write_export(out_dir: str, model: onnx.ModelProto, spec: dict) -> str:
    """``model.onnx``, ``openvino/model.xml``, ``export.json``."""
    os.makedirs(out_dir, exist_ok=True)
    onnx_path = osp.join(out_dir, 'model.onnx')
    onnx.save(model, onnx_path)
    os.makedirs(osp.join(out_dir, 'openvino'), exist_ok=True)
    ov.save_model(ov.convert_model(onnx_path), osp.join(out_dir, 'openvino', 'model.xml'),
                  compress_to_fp16=False)
    with open(osp.join(out_dir, 'export.json'), 'w') as f:
        json.dump(spec, f, indent=2)
    return out_dir


def det_spec() -> dict:
    return dict(
        schema_version=1, part='model', task='instance_segmentation',
        outputs=['dets', 'labels', 'masks'], shape=[192, 320], dynamic=True,
        pipeline=dict(resize=dict(scale=DET_SCALE, keep_ratio=True), mean=MEAN, std=STD,
                      bgr_to_rgb=True, pad_size_divisor=32, pad_value=0.0, size=None),
        classes=CLASSES, mask_thr_binary=0.5, checkpoint_sha256='ab' * 32, precision='fp32')


def seg_spec(output: str) -> dict:
    return dict(
        schema_version=1, part='model', task='semantic_segmentation', outputs=[output],
        shape=SEG_SIZE, dynamic=False,
        pipeline=dict(resize=dict(scale=SEG_SCALE, keep_ratio=False), mean=MEAN, std=STD,
                      bgr_to_rgb=True, pad_size_divisor=None, pad_value=0.0, size=SEG_SIZE),
        classes=SEG_CLASSES, palette=[[0, 0, 0], [255, 0, 0], [0, 0, 255], [0, 255, 0]])


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    """Images, export directories and the blocking packages, built once."""
    root = tmp_path_factory.mktemp('predict')
    mpl = importlib.util.find_spec('matplotlib')
    photo = mpl and osp.join(osp.dirname(mpl.origin), 'mpl-data', 'sample_data',
                             'grace_hopper.jpg')
    if not (photo and osp.isfile(photo)):
        pytest.skip('matplotlib\'s sample photograph grace_hopper.jpg is not installed')
    src = cv2.imread(photo)
    assert src.shape[0] >= 500 and src.shape[1] >= 460, src.shape
    images = {
        'portrait': (src[40:477, 100:401], 'png'),  # 301 x 437 (w x h)
        'landscape': (np.ascontiguousarray(src[10:510, 70:453].transpose(1, 0, 2)), 'jpg'),
    }
    paths = {}
    for name, (img, ext) in images.items():
        paths[name] = str(root / f'{name}.{ext}')
        cv2.imwrite(paths[name], img, [cv2.IMWRITE_JPEG_QUALITY, 100] if ext == 'jpg' else [])
    originals = {name: cv2.imread(p) for name, p in paths.items()}  # as decoded (jpg lossy)

    blocked = root / 'blocked'
    for name in BLOCKED:
        (blocked / name).mkdir(parents=True)
        (blocked / name / '__init__.py').write_text(
            f'raise ModuleNotFoundError({name + " must not be imported"!r}, name={name!r})\n')

    det = write_export(str(root / 'det'), make_graph(
        dict(dets=DETS, labels=LABELS, masks=det_masks()), [1, 3, 'h', 'w']), det_spec())
    seg = write_export(str(root / 'seg'), make_graph(
        dict(seg_logits=seg_logits()), [1, 3, *SEG_SIZE]), seg_spec('seg_logits'))
    seg_label = write_export(str(root / 'seg_label'), make_graph(
        dict(seg_logits=seg_logits()), [1, 3, *SEG_SIZE], argmax=True), seg_spec('seg_label'))
    return dict(root=root, paths=paths, originals=originals, blocked=str(blocked), det=det,
                seg=seg, seg_label=seg_label)


def predict(data, export_dir, out, *extra, images=None):
    """Run the predictor without torch; returns the finished process."""
    env = dict(os.environ, OMP_NUM_THREADS='1')
    env['PYTHONPATH'] = os.pathsep.join(
        p for p in (data['blocked'], REPO, os.environ.get('PYTHONPATH', '')) if p)
    images = images or [data['paths']['portrait'], data['paths']['landscape']]
    args = [sys.executable, '-m', 'mmslab.deploy.predict', export_dir, *images,
            '--out', str(out), '--threads', '1', *extra]
    return subprocess.run(args, cwd=str(data['root']), env=env, capture_output=True,
                          text=True, timeout=120)


def run_ok(data, export_dir, out, *extra):
    proc = predict(data, export_dir, out, *extra)
    assert proc.returncode == 0, f'exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}'
    assert 'Warning' not in proc.stderr, proc.stderr  # no torch is the expected case
    return proc


def expected_scale(w: int, h: int, scale=DET_SCALE):
    """mmcv's ``rescale_size`` and mmdet's per-axis ``scale_factor``, written out."""
    f = min(max(scale) / max(h, w), min(scale) / min(h, w))
    new_w, new_h = int(w * f + 0.5), int(h * f + 0.5)
    return new_w / w, new_h / h


RUNTIME_PARAMS = ['onnxruntime', 'openvino']


# ----------------------------------------------------------------------------------------------
# the blocking packages really block
# ----------------------------------------------------------------------------------------------

def test_blocked_packages_block(data):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((data['blocked'], REPO)))
    for code in (f'import {name}' for name in BLOCKED):
        proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode != 0 and 'must not be imported' in proc.stderr, code


# ----------------------------------------------------------------------------------------------
# instance segmentation
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('runtime', RUNTIME_PARAMS)
def test_instance_segmentation(data, runtime, tmp_path):
    proc = run_ok(data, data['det'], tmp_path, '--runtime', runtime, '--score-thr', '0.3')
    assert 'checkpoint_sha256=' + 'ab' * 32 in proc.stdout  # extra keys are printed
    assert proc.stdout.count('2 detections') == 2, proc.stdout
    for name, original in data['originals'].items():
        h, w = original.shape[:2]
        with open(tmp_path / f'{name}.json') as f:
            record = json.load(f)
        assert (record['width'], record['height']) == (w, h)
        dets = record['detections']
        assert [d['label'] for d in dets] == [1, 2]
        assert [d['class'] for d in dets] == ['bicycle', 'car']
        assert [d['score'] for d in dets] == pytest.approx([0.95, 0.6], abs=1e-5)

        sx, sy = expected_scale(w, h)
        assert record['scale_factor'] == pytest.approx([sx, sy])
        for det, ref in zip(dets, DETS):
            box = np.array(ref[:4]) / [sx, sy, sx, sy]
            box = np.clip(box, 0, [w, h, w, h])
            assert det['bbox'] == pytest.approx(box.tolist(), abs=2e-3), name

        # det 0: RoI map 0.9 everywhere -> the whole (clipped) box; det 1: its left half.
        # Within about a pixel along the border (bilinear ramp at the box edges, pixel
        # centres; exactness against mmdet is test_paste_mask_matches_mmdet).
        for det, fraction in zip(dets, (1.0, 0.5)):
            x1, y1, x2, y2 = det['bbox']
            bw, bh = x2 - x1, y2 - y1
            assert abs(det['mask_area'] - fraction * bw * bh) <= 2 * (bw + bh), (name, det)
            mx1, my1, mx2, my2 = det['mask_bbox']
            assert x1 - 1 <= mx1 and y1 - 1 <= my1 and mx2 <= x2 + 1 and my2 <= y2 + 1
            assert mx2 - mx1 == pytest.approx(fraction * bw, abs=2)
        if name == 'landscape':  # the box reaches below the resized image: clipped
            assert dets[0]['bbox'][3] == h

        index = cv2.imread(str(tmp_path / record['masks_png']), cv2.IMREAD_UNCHANGED)
        assert index.shape == (h, w) and index.dtype == np.uint8
        assert (index == 1).sum() == dets[0]['mask_area']  # the highest score wins overlaps
        assert set(np.unique(index)) == {0, 1, 2}

        drawn = cv2.imread(str(tmp_path / f'{name}.jpg'))
        assert drawn.shape == original.shape
        x1, y1, x2, y2 = (int(v) for v in dets[0]['bbox'])
        inside = np.abs(drawn[y1 + 5:y2 - 5, x1 + 5:x2 - 5].astype(float) -
                        original[y1 + 5:y2 - 5, x1 + 5:x2 - 5]).mean()
        assert inside > 8, inside  # mask overlay


def test_score_threshold_and_detection_task(data, tmp_path):
    """A plain detection export (no masks) and a lower threshold: all three detections."""
    spec = dict(det_spec(), task='detection', outputs=['dets', 'labels'])
    export = write_export(str(tmp_path / 'export'),
                          make_graph(dict(dets=DETS, labels=LABELS), [1, 3, 'h', 'w']), spec)
    run_ok(data, export, tmp_path / 'out', '--score-thr', '0.05')
    with open(tmp_path / 'out' / 'portrait.json') as f:
        record = json.load(f)
    assert [d['label'] for d in record['detections']] == [1, 2, 0]
    assert 'mask_area' not in record['detections'][0]
    assert not (tmp_path / 'out' / 'portrait_masks.png').exists()


# ----------------------------------------------------------------------------------------------
# semantic segmentation
# ----------------------------------------------------------------------------------------------

def check_semantic(out_dir, data, nearest: bool):
    for name, original in data['originals'].items():
        h, w = original.shape[:2]
        with open(osp.join(out_dir, f'{name}.json')) as f:
            record = json.load(f)
        label = cv2.imread(osp.join(out_dir, record['label_png']), cv2.IMREAD_UNCHANGED)
        assert label.shape == (h, w)
        hist = {e['class']: e['pixels'] for e in record['histogram']}
        assert set(hist) == {'left', 'right'}  # no padding class, no class 0
        assert hist['left'] + hist['right'] == h * w
        assert hist['left'] == (label == 1).sum() and hist['right'] == (label == 2).sum()
        # the boundary is at the middle of the resized image, hence of the original
        border = int(np.ceil(w / 2)) if nearest else w / 2 - 0.5
        left = (label == 1).sum(1)
        assert np.all(np.abs(left - border) <= 1), (name, np.unique(left), border)
        drawn = cv2.imread(osp.join(out_dir, f'{name}.jpg'))
        assert drawn.shape == original.shape
        assert np.abs(drawn.astype(float) - original).mean() > 8


@pytest.mark.parametrize('runtime', RUNTIME_PARAMS)
def test_semantic_segmentation_logits(data, runtime, tmp_path):
    proc = run_ok(data, data['seg'], tmp_path, '--runtime', runtime)
    assert proc.stdout.count('2 classes') == 2, proc.stdout
    check_semantic(str(tmp_path), data, nearest=False)


def test_semantic_segmentation_label_in_graph(data, tmp_path):
    proc = run_ok(data, data['seg_label'], tmp_path)
    # not timed at export, no flags: onnxruntime fp32, and the first line says why
    assert proc.stdout.splitlines()[0] == (
        'export.json records no deployed form (tools/export_onnx.py --latency HxW measures '
        'one): running onnxruntime fp32; --runtime/--precision choose another'), proc.stdout
    assert proc.stdout.count('ms in onnxruntime fp32') == 2
    check_semantic(str(tmp_path), data, nearest=True)


# ----------------------------------------------------------------------------------------------
# clear errors
# ----------------------------------------------------------------------------------------------

def broken_export(data, tmp_path, change) -> str:
    spec = det_spec()
    change(spec)
    out = str(tmp_path / 'export')
    os.makedirs(out)
    with open(osp.join(out, 'export.json'), 'w') as f:
        json.dump(spec, f)
    os.symlink(osp.join(data['det'], 'model.onnx'), osp.join(out, 'model.onnx'))
    return out


@pytest.mark.parametrize('change,message', [
    (lambda s: s.pop('pipeline'), "lacks the key 'pipeline'"),
    (lambda s: s['pipeline'].pop('size'), "lacks the key 'pipeline.size'"),
    (lambda s: s.update(part='features'), 'not a whole model'),
    (lambda s: s.update(task='panoptic'), "unknown task 'panoptic'"),
    (lambda s: s.update(outputs=['dets', 'labels']), 'lack masks'),
    # an export written before export.json had a schema version, and a stale one
    (lambda s: s.pop('schema_version'), 'records no schema_version: it was written before '
     'export.json had one (or by hand); export again with tools/export_onnx.py'),
    (lambda s: s.update(schema_version=0), 'schema_version 0; this mmslab reads 1: export '
     'again with tools/export_onnx.py'),
])
def test_bad_export_json(data, tmp_path, change, message):
    proc = predict(data, broken_export(data, tmp_path, change), tmp_path / 'out')
    assert proc.returncode != 0
    assert message in proc.stderr and 'export.json' in proc.stderr, proc.stderr
    assert 'Traceback' not in proc.stderr


def test_precision_bf16(data, tmp_path):
    """``--precision bf16``: OpenVINO's bf16 hint on CPUs with bf16 units (the CPU check does
    not import torch), a clear refusal elsewhere and for onnxruntime; bad choices named."""
    from mmslab.utils.machine import has_bf16
    proc = predict(data, data['det'], tmp_path / 'bf16', '--runtime', 'openvino',
                   '--precision', 'bf16')
    if has_bf16():
        assert proc.returncode == 0, proc.stderr
        assert 'openvino bf16' in proc.stdout and 'ms in openvino bf16' in proc.stdout
        with open(tmp_path / 'bf16' / 'portrait.json') as f:
            record = json.load(f)
        assert record['precision'] == 'bf16'
        assert [d['label'] for d in record['detections']] == [1, 2]
    else:
        assert proc.returncode != 0 and 'avx512_bf16 or amx_bf16' in proc.stderr
    assert 'Traceback' not in proc.stderr
    proc = predict(data, data['det'], tmp_path / 'ort', '--precision', 'bf16')
    assert proc.returncode != 0 and 'onnxruntime has no bf16' in proc.stderr
    assert 'Valid with onnxruntime: fp32, int8' in proc.stderr
    assert 'Traceback' not in proc.stderr
    proc = predict(data, data['det'], tmp_path / 'x', '--precision', 'fp16')
    assert proc.returncode != 0 and "invalid choice: 'fp16'" in proc.stderr
    proc = run_ok(data, data['det'], tmp_path / 'fp32', '--precision', 'fp32')
    assert 'onnxruntime fp32' in proc.stdout


def test_missing_artifacts_and_images(data, tmp_path):
    proc = predict(data, data['det'], tmp_path, '--int8')
    assert proc.returncode != 0 and 'model_int8.onnx' in proc.stderr
    assert '--int8' in proc.stderr and 'tools/export_onnx.py' in proc.stderr
    proc = predict(data, str(tmp_path / 'nowhere'), tmp_path)
    assert proc.returncode != 0 and 'does not exist' in proc.stderr

    garbage = tmp_path / 'garbage.jpg'
    garbage.write_bytes(b'not an image')
    proc = predict(data, data['det'], tmp_path / 'out',
                   images=[str(garbage), data['paths']['portrait']])
    assert proc.returncode != 0 and 'cannot decode image' in proc.stderr
    assert (tmp_path / 'out' / 'portrait.json').exists()  # the other images still run
    assert 'Traceback' not in proc.stderr


# ----------------------------------------------------------------------------------------------
# the deployed form export.json records: the default
# ----------------------------------------------------------------------------------------------

def deployed_export(data, out_dir, runtime: str, precision: str, int8: bool = True) -> str:
    """The instance-segmentation export whose ``export.json`` records ``runtime precision``
    as the deployed form (``latency`` as ``tools/export_onnx.py --latency`` writes it); with
    ``int8``, INT8 artifacts that are copies of the fp32 graphs (the predictor runs the
    file of the artifact's name: which one ran is what the test reads)."""
    out = str(out_dir)
    shutil.copytree(data['det'], out)
    if int8:
        shutil.copy(osp.join(out, 'model.onnx'), osp.join(out, 'model_int8.onnx'))
        for ext in ('xml', 'bin'):
            shutil.copy(osp.join(out, 'openvino', f'model.{ext}'),
                        osp.join(out, 'openvino', f'model_int8.{ext}'))
    timed = f'{runtime} {precision}'
    spec = dict(det_spec(), precisions=['fp32', 'int8'] if int8 else ['fp32'], latency=dict(
        shape='800x1333', input=[800, 1344], repeat=3,
        median_ms={'eager fp32': 900.0, 'onnxruntime fp32': 400.0, timed: 300.0},
        deploy=dict(runtime=runtime, precision=precision, median_ms=300.0,
                    reason=f'{timed} 300 ms is the fastest {precision} form')))
    with open(osp.join(out, 'export.json'), 'w') as f:
        json.dump(spec, f, indent=2)
    return out


DEPLOYED_LINE = ('deployed form from export.json: openvino int8 (chosen by '
                 'tools/export_onnx.py --latency 800x1333); --runtime/--precision choose '
                 'another')


def test_deployed_form_is_the_default(data, tmp_path):
    """The README's command (no --runtime, no --precision) runs the deployed form and says
    so; an export without one runs onnxruntime fp32 (test_semantic_segmentation_label_in_graph)."""
    export = deployed_export(data, tmp_path / 'export', 'openvino', 'int8')
    proc = run_ok(data, export, tmp_path / 'out')
    assert proc.stdout.splitlines()[0] == DEPLOYED_LINE, proc.stdout
    assert proc.stdout.count('ms in openvino int8') == 2, proc.stdout
    with open(tmp_path / 'out' / 'portrait.json') as f:
        record = json.load(f)
    assert (record['runtime'], record['precision']) == ('openvino', 'int8')
    assert [d['label'] for d in record['detections']] == [1, 2]


@pytest.mark.parametrize('runtime,precision,ran,source', [
    ('onnxruntime', None, ('onnxruntime', 'fp32'), 'command line'),  # another runtime: fp32
    (None, 'fp32', ('openvino', 'fp32'), 'command line'),  # the deployed runtime
    ('openvino', None, ('openvino', 'int8'), 'export.json'),  # the deployed precision
    ('onnxruntime', 'int8', ('onnxruntime', 'int8'), 'command line'),
])
def test_flags_choose_another_form(data, tmp_path, runtime, precision, ran, source):
    from mmslab.deploy.predict import Predictor
    export = deployed_export(data, tmp_path / 'export', 'openvino', 'int8')
    predictor = Predictor(export, runtime, threads=1, precision=precision)
    assert (predictor.runtime, predictor.precision) == ran
    assert predictor.form.source == source
    artifacts = {('onnxruntime', 'fp32'): 'model.onnx', ('onnxruntime', 'int8'): 'model_int8.onnx',
                 ('openvino', 'fp32'): 'openvino/model.xml',
                 ('openvino', 'int8'): 'openvino/model_int8.xml'}
    assert predictor.path == osp.join(export, artifacts[ran])
    if source == 'export.json':
        assert predictor.form.note == DEPLOYED_LINE
    else:
        said = ' and '.join(f for f, v in (('--runtime', runtime), ('--precision', precision))
                            if v is not None)
        assert predictor.form.note == (
            f'running {ran[0]} {ran[1]} as {said} {"say" if " and " in said else "says"}; the '
            'deployed form in export.json is openvino int8 (chosen by tools/export_onnx.py '
            '--latency 800x1333)')


def test_deployed_form_that_cannot_run_here_falls_back(data, tmp_path, monkeypatch):
    """Its INT8 artifact missing, bf16 on a CPU without bf16 units, OpenVINO not installed:
    the same runtime's fp32, else onnxruntime, and the note says why; what the command line
    names is not replaced (a missing INT8 file it asks for is an error); a record that names
    no valid form is an error naming the valid ones."""
    from mmslab.deploy import runtimes
    from mmslab.deploy.predict import PredictError, Predictor
    from mmslab.utils import machine

    export = deployed_export(data, tmp_path / 'no_int8', 'openvino', 'int8', int8=False)
    predictor = Predictor(export, threads=1)
    assert (predictor.runtime, predictor.precision, predictor.form.source) == \
        ('openvino', 'fp32', 'fallback')
    assert predictor.form.note == (
        'deployed form from export.json: openvino int8 (chosen by tools/export_onnx.py '
        f'--latency 800x1333), but {export}/openvino/model_int8.xml does not exist (exported '
        'without --int8): running openvino fp32 instead; --runtime/--precision choose another')
    with pytest.raises(PredictError, match='no INT8 openvino model at .*--int8'):
        Predictor(export, precision='int8')

    monkeypatch.setattr(machine, 'cpu_flags', lambda: ['avx2'])
    export = deployed_export(data, tmp_path / 'bf16', 'openvino', 'bf16', int8=False)
    predictor = Predictor(export, threads=1)
    assert (predictor.runtime, predictor.precision) == ('openvino', 'fp32')
    assert 'but this CPU has neither avx512_bf16 nor amx_bf16: running openvino fp32' in \
        predictor.form.note

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(runtimes.importlib.util, 'find_spec',
                        lambda name, *a: None if name == 'openvino' else find_spec(name, *a))
    export = deployed_export(data, tmp_path / 'no_openvino', 'openvino', 'int8')
    predictor = Predictor(export, threads=1)
    assert (predictor.runtime, predictor.precision) == ('onnxruntime', 'fp32')
    assert 'but OpenVINO is not installed here: running onnxruntime fp32 instead' in \
        predictor.form.note
    monkeypatch.undo()

    spec = dict(det_spec(), latency=dict(shape='800x1333', deploy=dict(runtime='tensorrt',
                                                                        precision='fp16')))
    with open(osp.join(export, 'export.json'), 'w') as f:
        json.dump(spec, f)
    with pytest.raises(PredictError, match=r'latency.deploy must name a runtime and a '
                       r'precision it computes \(onnxruntime: fp32, int8; openvino: fp32, '
                       r'bf16, int8\)'):
        Predictor(export)


# ----------------------------------------------------------------------------------------------
# parity of the numpy post-processing with mmdet / PyTorch (where installed)
# ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(not (_has('torch') and _has('mmdet')), reason='needs torch and mmdet')
def test_paste_mask_matches_mmdet():
    import torch
    from mmdet.models.roi_heads.mask_heads.fcn_mask_head import _do_paste_mask

    from mmslab.deploy.predict import paste_mask
    rng = np.random.RandomState(0)
    img_h, img_w = 97, 131
    for _ in range(20):
        x0, y0 = rng.uniform(-3, 100, 2)
        box = np.array([x0, y0, x0 + rng.uniform(0.5, 60), y0 + rng.uniform(0.5, 60)])
        box = np.clip(box, 0, [img_w, img_h, img_w, img_h]).astype(np.float32)
        if box[2] <= box[0] or box[3] <= box[1]:
            continue
        mask = rng.rand(28, 28).astype(np.float32)
        ref, (ys, xs) = _do_paste_mask(torch.from_numpy(mask)[None, None],
                                       torch.from_numpy(box)[None], img_h, img_w, True)
        y0_, x0_, probs = paste_mask(mask, box, img_h, img_w)
        assert (y0_, x0_) == (ys.start, xs.start)
        np.testing.assert_allclose(probs, ref[0].numpy(), atol=1e-5)


@pytest.mark.skipif(not _has('torch'), reason='needs torch')
@pytest.mark.parametrize('align_corners', [False, True])
def test_bilinear_resize_matches_torch(align_corners):
    import torch
    import torch.nn.functional as F

    from mmslab.deploy.predict import nearest_indices, resize_bilinear
    x = np.random.RandomState(0).randn(5, 13, 17).astype(np.float32)
    for size in ((52, 68), (7, 30), (13, 17)):
        ref = F.interpolate(torch.from_numpy(x)[None], size=size, mode='bilinear',
                            align_corners=align_corners)[0].numpy()
        np.testing.assert_allclose(resize_bilinear(x, *size, align_corners), ref, atol=1e-5)
        ref = F.interpolate(torch.arange(13.)[None, None, :, None], size=(size[0], 1),
                            mode='nearest')[0, 0, :, 0].numpy()
        np.testing.assert_array_equal(nearest_indices(size[0], 13), ref)


@pytest.mark.skipif(not _has('mmcv'), reason='needs mmcv')
def test_resize_matches_mmcv():
    from mmcv.image.geometric import rescale_size

    from mmslab.deploy.predict import resized_size
    for w, h in ((301, 437), (500, 383), (640, 480), (1, 999), (1333, 800)):
        for scale in ((1333, 800), (2048, 512), (320, 192)):
            assert resized_size(w, h, scale, True) == tuple(rescale_size((w, h), scale))
