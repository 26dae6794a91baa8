"""Checkpoints that hold pickled objects besides the weights (docs/checkpoint_formats.md).

The SLAB authors' training script saves its yacs ``CfgNode`` under ``config``, RePaViT's
``main.py`` its ``argparse.Namespace`` under ``args``. mmslab reads the tensors of such files and
ignores the foreign objects without importing or executing anything from the file; a file whose
pickle would run code either loads without running it or is refused.

The yacs stand-in lives in a module written under ``tmp_path``: its global is
``<module>.CfgNode``, which the loader must neither import nor call. Importing the module, or
calling its ``__setstate__`` or its ``touch`` function, leaves a marker file.
"""
import argparse
import importlib.util
import os
import pickle
import re
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch

from conftest import load_tool, randomize_weights
from layouts import SWIN, assert_same_outputs, outputs, slab_swin, to_authors_swin

import mmslab.engine  # noqa: F401  (installs the local-path loader in mmengine)
import mmslab.utils.checkpoint as safe
from mmslab.utils.checkpoint import ForeignObject, load_checkpoint_file
from mmslab.models import RePaSwin, SLABSwin
from mmslab.models.checkpoint_utils import convert_checkpoint_file, load_pretrained_backbone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STUB = '''
import os
MARKERS = {markers!r}
open(os.path.join(MARKERS, 'imported'), 'w').close()


def touch(name):
    open(os.path.join(MARKERS, name), 'w').close()
    return name


class CfgNode(dict):
    """Like yacs.config.CfgNode: a dict subclass with attribute access and an immutable flag."""

    def __init__(self, init_dict=None):
        super().__init__()
        for k, v in (init_dict or {{}}).items():
            self[k] = CfgNode(v) if isinstance(v, dict) else v
        self.__dict__['__immutable__'] = False

    def __getattr__(self, name):
        if name in self:
            return self[name]
        raise AttributeError(name)

    def __setstate__(self, state):
        touch('setstate')
        self.__dict__.update(state)


class Payload:
    """Unpickling this calls touch('payload')."""

    def __reduce__(self):
        return touch, ('payload', )
'''


@pytest.fixture
def authors_module(tmp_path, monkeypatch):
    """A fresh ``authors_<id>`` module with ``CfgNode``, ``touch`` and ``Payload``; importable
    while the test runs (so an import by the loader would be seen), markers in ``markers``."""
    markers = tmp_path / 'markers'
    markers.mkdir()
    name = f'authors_{uuid.uuid4().hex[:8]}'
    src = tmp_path / 'modules'
    src.mkdir()
    (src / f'{name}.py').write_text(STUB.format(markers=str(markers)))
    monkeypatch.syspath_prepend(str(src))  # undone after the test
    try:
        module = importlib.import_module(name)
        module.markers = markers
        yield module
    finally:
        sys.modules.pop(name, None)


def forget_import(module):
    """Remove the module from ``sys.modules`` and its import marker: a later import would show."""
    sys.modules.pop(module.__name__, None)
    for f in module.markers.iterdir():
        f.unlink()


def markers(module):
    return sorted(p.name for p in module.markers.iterdir())


def yacs_config(module):
    return module.CfgNode(dict(MODEL=dict(TYPE='swin', NAME='slab_swin_tiny',
                                          SWIN=dict(DEPTHS=[2, 2, 6, 2], WINDOW_SIZE=7)),
                               TRAIN=dict(EPOCHS=300, BASE_LR=1e-3), OUTPUT='output'))


def repavit_args():
    return argparse.Namespace(model='RePaSwin_tiny', lr=1e-3, epochs=300, idle_ratio=0.75,
                              output_dir='output', batch_size=128)


@pytest.fixture
def log(monkeypatch):
    """Messages the loader logs through ``print_log``."""
    messages = []
    monkeypatch.setattr(safe, 'print_log', lambda msg, logger=None, **kw: messages.append(msg))
    return messages


def assert_same_tensors(loaded, expected):
    assert set(loaded) == set(expected)
    for k, v in expected.items():
        assert type(loaded[k]) is torch.Tensor, k
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k


def slab_training_checkpoint(path, module, model_sd):
    """What the SLAB authors' ``save_checkpoint`` writes."""
    torch.save({'model': model_sd, 'optimizer': {'state': {}, 'param_groups': [{'lr': 1e-3}]},
                'lr_scheduler': {'last_epoch': 299}, 'max_accuracy': 81.2, 'epoch': 299,
                'config': yacs_config(module)}, path)
    return str(path)


# ------------------------------------------------------------------------------------------
# The authors' files
# ------------------------------------------------------------------------------------------
def test_slab_file_with_yacs_config(tmp_path, authors_module, log):
    src = slab_swin()
    authors = to_authors_swin(src.state_dict(), schedule=(0, 60000, 0))
    path = slab_training_checkpoint(tmp_path / 'slab.pth', authors_module, authors)
    forget_import(authors_module)
    with pytest.raises(pickle.UnpicklingError, match='CfgNode'):  # torch alone refuses it
        torch.load(path, map_location='cpu', weights_only=True)
    with pytest.raises(pickle.UnpicklingError, match='CfgNode'):
        load_checkpoint_file(path, ignore_foreign=False)

    loaded = load_checkpoint_file(path)
    assert set(loaded) == {'model', 'optimizer', 'lr_scheduler', 'max_accuracy', 'epoch'}
    assert_same_tensors(loaded['model'], authors)
    assert loaded['optimizer'] == {'state': {}, 'param_groups': [{'lr': 1e-3}]}
    assert loaded['epoch'] == 299 and loaded['max_accuracy'] == 81.2
    assert any(f'ignored config ({authors_module.__name__}.CfgNode)' in m for m in log), log
    assert markers(authors_module) == [], 'the loader imported or ran code from the file'
    assert safe.HistoryBuffer not in torch.serialization.get_safe_globals()

    # converted and loaded strictly (convert_checkpoint_file checks that), same features
    out = str(tmp_path / 'mmslab.pth')
    meta = convert_checkpoint_file(path, out, log=None)
    assert meta['source_format'] == 'slab' and meta['backbone_cfg']['type'] == 'SLABSwin'
    dst = SLABSwin(**SWIN, window_size=(8, 4, 4, 4))
    info = load_pretrained_backbone(dst, out)
    assert not info['missing'] and not info['unexpected'] and not info['shape_mismatch']
    for i in range(4):
        getattr(dst, f'norm{i}').load_state_dict(getattr(src, f'norm{i}').state_dict())
    x = torch.randn(1, 3, 64, 64)
    assert_same_outputs(outputs(dst.eval(), x), outputs(src, x))

    # init_cfg Pretrained straight from the authors' file
    via_cfg = SLABSwin(**SWIN, window_size=(8, 4, 4, 4), pretrained=path)
    via_cfg.init_weights()
    own = dst.state_dict()
    for k, v in via_cfg.state_dict().items():
        if not re.match(r'norm\d+\.', k):  # output norms: not in a classification file
            assert torch.equal(v, own[k]), k
    assert markers(authors_module) == []


def test_repavit_file_with_argparse_namespace(tmp_path, log):
    src = randomize_weights(RePaSwin(**SWIN, window_size=4), seed=3)
    authors = to_authors_swin(src.state_dict())
    path = str(tmp_path / 'repavit.pth')
    torch.save({'model': authors, 'optimizer': {'state': {}}, 'epoch': 299,
                'args': repavit_args()}, path)
    loaded = load_checkpoint_file(path)
    assert set(loaded) == {'model', 'optimizer', 'epoch'}
    assert_same_tensors(loaded['model'], authors)
    assert any('ignored args (argparse.Namespace)' in m for m in log), log

    # through the tool's main() in this process
    tool = load_tool('convert_checkpoint')
    out = str(tmp_path / 'repa_mmslab.pth')
    assert tool.main([path, out, '--format', 'repavit']) == 0
    dst = RePaSwin(**SWIN, window_size=4)
    info = load_pretrained_backbone(dst, out)
    assert info['format'] == 'mmslab' and not info['missing'] and not info['unexpected']
    for i in range(4):
        getattr(dst, f'norm{i}').load_state_dict(getattr(src, f'norm{i}').state_dict())
    x = torch.randn(2, 3, 64, 64)
    assert_same_outputs(outputs(dst.eval(), x), outputs(src, x))


@pytest.mark.slow  # tools/convert_checkpoint.py in subprocesses
def test_convert_tool_in_a_fresh_process(tmp_path, authors_module):
    """A fresh process cannot even import the module that defined the CfgNode."""
    src = slab_swin()
    path = slab_training_checkpoint(tmp_path / 'slab.pth', authors_module,
                                    to_authors_swin(src.state_dict()))
    payload_path = str(tmp_path / 'payload.pth')
    torch.save({'model': to_authors_swin(src.state_dict()), 'config': authors_module.Payload(),
                'extra': [authors_module.Payload()]}, payload_path)
    forget_import(authors_module)
    tool = os.path.join(ROOT, 'tools', 'convert_checkpoint.py')
    for src_path in (path, payload_path):
        out = str(tmp_path / 'out.pth')
        proc = subprocess.run([sys.executable, tool, src_path, out], capture_output=True,
                              text=True, timeout=300, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        text = proc.stdout + proc.stderr
        assert 'ignored config' in text and 'wrote' in text, text
        assert 'SLABSwin' in text
        ckpt = torch.load(out, map_location='cpu', weights_only=True)
        assert ckpt['meta']['source_format'] == 'slab'
        os.remove(out)
    assert 'extra' in text  # the list holding payloads went too
    assert markers(authors_module) == []


# ------------------------------------------------------------------------------------------
# mmengine's entry points (load_from, init_cfg Pretrained of any model, load_checkpoint)
# ------------------------------------------------------------------------------------------
def test_mmengine_loaders_ignore_foreign_objects(tmp_path, authors_module):
    from mmdet.models.backbones import ResNet
    from mmengine.runner import CheckpointLoader, load_checkpoint
    from mmengine.runner.checkpoint import _load_checkpoint

    assert CheckpointLoader._schemes[''] is safe.load_from_local
    model = randomize_weights(SLABSwin(**SWIN, window_size=(8, 4, 4, 4)), seed=5)
    state = model.state_dict()
    path = str(tmp_path / 'mmslab_with_cfg.pth')
    torch.save({'state_dict': state, 'meta': {'epoch': 3, 'cfg': 'text'},
                'config': yacs_config(authors_module), 'args': repavit_args()}, path)
    resnet = ResNet(depth=18, base_channels=8, stem_channels=8)
    randomize_weights(resnet, seed=2)  # (ResNet.train returns None)
    rpath = str(tmp_path / 'resnet.pth')
    torch.save({'state_dict': {f'backbone.{k}': v for k, v in resnet.state_dict().items()},
                'args': repavit_args(), 'config': yacs_config(authors_module)}, rpath)
    forget_import(authors_module)

    for loaded in (CheckpointLoader.load_checkpoint(path, map_location='cpu'),
                   _load_checkpoint(path, map_location='cpu')):
        assert set(loaded) == {'state_dict', 'meta'} and loaded['meta']['epoch'] == 3
        assert_same_tensors(loaded['state_dict'], state)

    target = SLABSwin(**SWIN, window_size=(8, 4, 4, 4))
    load_checkpoint(target, path, map_location='cpu', strict=True)  # what load_from does
    for k, v in target.state_dict().items():
        assert torch.equal(v, state[k]), k

    # init_cfg Pretrained of an mmdet model goes through mmengine's PretrainedInit
    built = ResNet(depth=18, base_channels=8, stem_channels=8,
                   init_cfg=dict(type='Pretrained', checkpoint=rpath, prefix='backbone.'))
    built.init_weights()
    for k, v in built.state_dict().items():
        assert torch.equal(v, resnet.state_dict()[k]), k
    assert markers(authors_module) == []


def test_runner_checkpoint_objects_survive_next_to_a_foreign_object(tmp_path, log):
    """The fallback keeps mmslab's allow-list: HistoryBuffer and numpy data come back."""
    from mmengine.logging import HistoryBuffer
    buf = HistoryBuffer()
    for v in (1.0, 2.0, 3.0):
        buf.update(v)
    path = str(tmp_path / 'runner_like.pth')
    torch.save({'state_dict': {'w': torch.ones(3)},
                'message_hub': {'log_scalars': {'train/loss': buf},
                                'runtime_info': {'iter': np.int64(7), 'arr': np.arange(3),
                                                 'args': repavit_args()}},
                'meta': {'seed': 1}}, path)
    loaded = load_checkpoint_file(path)
    hub = loaded['message_hub']
    assert isinstance(hub['log_scalars']['train/loss'], HistoryBuffer)
    assert hub['log_scalars']['train/loss'].mean() == 2.0
    assert hub['runtime_info']['iter'] == 7 and hub['runtime_info']['arr'].tolist() == [0, 1, 2]
    assert 'args' not in hub['runtime_info']  # only the foreign entry is dropped
    assert any('ignored message_hub.runtime_info.args (argparse.Namespace)' in m for m in log)
    assert HistoryBuffer not in torch.serialization.get_safe_globals()


def test_legacy_serialization_format(tmp_path, authors_module, log):
    sd = {'a.weight': torch.randn(4, 3), 'a.bias': torch.arange(4)}
    path = str(tmp_path / 'legacy.pth')
    torch.save({'model': sd, 'config': yacs_config(authors_module)}, path,
               _use_new_zipfile_serialization=False)
    forget_import(authors_module)
    loaded = load_checkpoint_file(path)
    assert set(loaded) == {'model'}
    assert_same_tensors(loaded['model'], sd)
    assert markers(authors_module) == []


# ------------------------------------------------------------------------------------------
# Files whose pickle would run code
# ------------------------------------------------------------------------------------------
class _OsSystem:

    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd, )


class _Call:

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def test_code_in_the_pickle_is_never_run(tmp_path, authors_module):
    marker = tmp_path / 'MARKER'
    sd = {'w': torch.randn(2, 3), 'b': torch.zeros(2, dtype=torch.int64)}
    touch = f'touch {marker}'
    py_touch = f'open({str(marker)!r}, "w").close()'
    cases = {
        'os_system': {'model': sd, 'config': _OsSystem(touch)},
        'subprocess': {'model': sd, 'args': _Call(subprocess.call, ['touch', str(marker)])},
        'eval': {'model': sd, 'cfg': _Call(eval, py_touch)},
        'exec': {'model': sd, 'cfg': [_Call(exec, py_touch)]},
        'import': {'model': sd, 'cfg': _Call(__import__, 'this')},
        'module_function': {'model': sd, 'config': authors_module.Payload()},
        'yacs_setstate': {'model': sd, 'config': yacs_config(authors_module)},
        'inside_the_state_dict': {'model': dict(sd, evil=_OsSystem(touch)), 'epoch': 1},
        'dict_key': {'model': sd, 'meta': {_Call(os.system, touch): 1}},
        'object_array': {'model': sd, 'meta': np.array([_OsSystem(touch)], dtype=object)},
    }
    for name, obj in cases.items():
        torch.save(obj, str(tmp_path / f'{name}.pth'))
    forget_import(authors_module)
    for name in cases:
        loaded = load_checkpoint_file(str(tmp_path / f'{name}.pth'))
        assert_same_tensors(loaded['model'], sd)
        assert set(loaded) <= {'model', 'epoch', 'meta'}, (name, set(loaded))
        assert not marker.exists(), f'{name}: code from the file was executed'
        assert markers(authors_module) == [], name

    # a file that is nothing but a foreign object is refused
    path = str(tmp_path / 'bare.pth')
    torch.save(_OsSystem(touch), path)
    with pytest.raises(pickle.UnpicklingError, match='posix.system|os.system'):
        load_checkpoint_file(path)
    assert not marker.exists()


def test_unreadable_foreign_data_is_refused_clearly(tmp_path):
    """A pickled ``getattr`` (mmslab's stand-in only returns HistoryBuffer's statistics methods)
    stops the restricted read too: refused, torch's message kept, nothing run. Through the tool:
    exit code 2 and a one-line reason."""
    marker = tmp_path / 'MARKER'
    path = str(tmp_path / 'getattr.pth')
    torch.save({'model': {'w': torch.ones(2)},
                'cfg': _Call(getattr, subprocess.Popen, '__init__')}, path)
    with pytest.raises(pickle.UnpicklingError) as err:
        load_checkpoint_file(path)
    message = str(err.value)
    assert 'weights only' in message.lower() and 'getattr' in message
    assert 'mmslab could not read' in message and 'nothing from it was executed' in message
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'tools', 'convert_checkpoint.py'),
                           path, str(tmp_path / 'out.pth')], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and 'refused' in proc.stderr, proc.stderr
    assert not marker.exists() and not (tmp_path / 'out.pth').exists()


def test_placeholders_are_inert():
    cls = type('Foreign_x', (ForeignObject, ), dict(__slots__=(), foreign_name='m.x'))
    obj = cls(1, 2, key=3)
    obj.__setstate__({'__class__': dict, 'cmd': 'rm -rf /'})
    obj['a'] = 1
    obj.append(1)
    obj.extend([1])
    assert not hasattr(obj, '__dict__') and type(obj) is cls
    assert repr(obj) == '<ignored m.x object>'
    with torch.serialization.safe_globals(safe.safe_globals_for_checkpoints()):
        allowed = safe._allowed_globals()
    for name in ('builtins.eval', 'builtins.exec', 'builtins.__import__', 'os.system',
                 'posix.system', 'subprocess.call', 'sys.modules'):
        assert name not in allowed
    assert allowed['builtins.getattr'] is safe._history_buffer_getattr  # the restricted one
