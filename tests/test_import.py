"""What ``import mmslab`` does, each case in a fresh interpreter.

* A config that only says ``custom_imports=dict(imports=['mmslab'])`` gets everything it needs
  from that line: the model components in mmdet's and mmseg's ``MODELS``, the hooks in
  mmengine's ``HOOKS`` and mmslab's restricted loader for local checkpoint files in mmengine's
  ``CheckpointLoader`` (which ``load_from``, ``--resume`` and ``init_cfg`` Pretrained use).
  Nothing else global changes: environment, warning filters, logging, torch's threads and
  default dtype are as before (once mmdet's and mmseg's own modules, which registering
  imports, are loaded).
* Without PyTorch (packages on ``PYTHONPATH`` that are not installed: importing them raises
  ``ModuleNotFoundError``), ``import mmslab`` registers nothing, says nothing, and the
  torch-free part imports; the PyTorch parts name what is missing. A partial install (mmseg
  missing beside PyTorch) is reported with a warning.
"""
import ast
import json
import os
import os.path as osp
import subprocess
import sys
import textwrap

from conftest import REPO


def run_python(code: str, blocked=(), tmp_path=None, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS='default')
    path = [REPO, os.environ.get('PYTHONPATH', '')]
    if blocked:
        root = tmp_path / 'not_installed'
        for name in blocked:
            (root / name).mkdir(parents=True, exist_ok=True)
            (root / name / '__init__.py').write_text(
                f'raise ModuleNotFoundError("No module named {name!r}", name={name!r})\n')
        path.insert(0, str(root))
    env['PYTHONPATH'] = os.pathsep.join(p for p in path if p)
    proc = subprocess.run([sys.executable, '-c', textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_custom_imports_alone_registers_and_installs_the_checkpoint_loader(tmp_path):
    config = tmp_path / 'only_custom_imports.py'
    config.write_text("custom_imports = dict(imports=['mmslab'], allow_failed_imports=False)\n")
    proc = run_python(f'''
        import json, logging, os, sys, warnings
        import torch, mmengine, mmcv, mmdet, mmseg
        from mmdet.registry import MODELS as DET, HOOKS as DET_HOOKS
        from mmseg.registry import MODELS as SEG, HOOKS as SEG_HOOKS
        from mmengine.registry import HOOKS
        # mmdet's and mmseg's models and hooks (registering mmslab's imports them to refuse a
        # name they have), with their own import-time changes (environment variables,
        # warning filters of the libraries they import), first
        for registry in (DET, SEG, DET_HOOKS, SEG_HOOKS):
            registry.import_from_location()
        from mmengine.runner import CheckpointLoader
        from mmengine.config import Config
        before = dict(env=dict(os.environ), filters=list(warnings.filters),
                      handlers=list(logging.root.handlers), level=logging.root.level,
                      threads=torch.get_num_threads(), dtype=torch.get_default_dtype())
        mmengine_loader = CheckpointLoader._schemes['']
        assert 'mmslab' not in sys.modules
        Config.fromfile({str(config)!r})  # imports mmslab, as any config naming it
        after = dict(env=dict(os.environ), filters=list(warnings.filters),
                     handlers=list(logging.root.handlers), level=logging.root.level,
                     threads=torch.get_num_threads(), dtype=torch.get_default_dtype())
        import mmslab.utils.checkpoint as safe
        print(json.dumps(dict(
            unchanged=[k for k in before if before[k] == after[k]],
            loader_was_mmengine=mmengine_loader.__module__.startswith('mmengine'),
            loader_is_mmslab=CheckpointLoader._schemes[''] is safe.load_from_local,
            det=[n in DET.module_dict for n in ('SLABSwin', 'PRepBN', 'ReparamPVT')],
            seg=[n in SEG.module_dict for n in ('SLABSwin', 'PRepBN', 'ReparamPVT')],
            hooks=[n in HOOKS.module_dict for n in ('ProgressiveNormHook', 'ReparamEvalHook',
                                                     'RuntimeBackendHook')])))
        ''')
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == dict(unchanged=['env', 'filters', 'handlers', 'level', 'threads', 'dtype'],
                          loader_was_mmengine=True, loader_is_mmslab=True, det=[True] * 3,
                          seg=[True] * 3, hooks=[True] * 3), result


def test_without_torch_the_package_imports_its_torch_free_part(tmp_path):
    proc = run_python('''
        import sys
        import mmslab
        import mmslab.deploy.runtimes
        from mmslab.deploy import export_info, predict
        assert 'torch' not in sys.modules and 'mmengine' not in sys.modules
        # the runtime layer never loads the export side (calibration, quantization, export)
        assert 'mmslab.deploy.quantize' not in sys.modules
        assert 'mmslab.deploy.onnx_export' not in sys.modules
        assert mmslab.deploy is sys.modules['mmslab.deploy']
        try:
            mmslab.reparameterize
        except ImportError as err:
            print(err)
        else:
            raise AssertionError('mmslab.reparameterize without torch')
        ''', blocked=('torch', 'mmcv', 'mmdet', 'mmengine', 'mmseg'), tmp_path=tmp_path)
    assert 'mmslab.reparameterize needs PyTorch and OpenMMLab; torch cannot be imported' in \
        proc.stdout, proc.stdout
    assert proc.stderr == ''  # a machine without PyTorch: nothing to warn about


def test_partial_install_is_reported(tmp_path):
    proc = run_python('''
        import mmslab
        from mmdet.registry import MODELS
        assert 'SLABSwin' not in MODELS.module_dict
        ''', blocked=('mmseg', ), tmp_path=tmp_path)
    assert 'RuntimeWarning: mmslab: mmseg cannot be imported' in proc.stderr, proc.stderr
    assert 'registers nothing with OpenMMLab' in proc.stderr


def imported_modules(path: str) -> set:
    """Every module a source file imports, at module level or inside a function, absolute
    (``from .x import y`` in ``mmslab/deploy`` -> ``mmslab.deploy.x``)."""
    package = osp.relpath(osp.dirname(path), REPO).replace(os.sep, '.')
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit('.', node.level - 1)[0] if node.level else ''
            names.add('.'.join(p for p in (base, node.module) if p))
    return names


#: docs/architecture.md's rows of ``mmslab``, lowest first: a module imports (at module level
#: or inside a function) only its own package and the packages of lower rows.
PACKAGE_LAYERS = {package: row for row, package in enumerate((
    'mmslab.registry', 'mmslab.utils', 'mmslab.datasets', 'mmslab.models', 'mmslab.deploy',
    'mmslab.benchmark', 'mmslab.engine'))}


def package_layer(module: str) -> int:
    for package, layer in PACKAGE_LAYERS.items():
        if module == package or module.startswith(package + '.'):
            return layer
    raise AssertionError(f'{module}: in no layer of PACKAGE_LAYERS')


def test_no_import_runs_up_a_layer():
    found = []
    for root, _, files in os.walk(osp.join(REPO, 'mmslab')):
        for name in sorted(f for f in files if f.endswith('.py')):
            path = osp.join(root, name)
            module = osp.relpath(path, REPO)[:-3].replace(os.sep, '.').removesuffix('.__init__')
            if module == 'mmslab':
                continue
            layer = package_layer(module)
            for target in imported_modules(path):
                if target.split('.')[0] != 'mmslab':
                    continue
                if package_layer(target) > layer:
                    found.append(f'{module} -> {target}')
    assert len(found) == 0, found


def test_the_runtime_layer_imports_no_export_side_and_no_pytorch():
    """The runtime layer and the predictor import nothing of the export side or of PyTorch /
    OpenMMLab."""
    def imports(rel):
        return imported_modules(osp.join(REPO, rel))

    for rel in ('mmslab/deploy/runtimes.py', 'mmslab/deploy/predict.py'):
        found = imports(rel)
        assert not {m for m in found if m.split('.')[0] in ('torch', 'mmengine', 'mmdet',
                                                            'mmseg', 'mmcv')}, (rel, found)
        assert not {'mmslab.deploy.quantize', 'mmslab.deploy.onnx_export'} & found, rel
    assert 'mmslab.deploy.export_info' in imports('mmslab/deploy/predict.py')
