"""The install recipe works in the real environment, not only behind the wheel cache.

``tools/install_deps.sh`` skips the mmcv build when a cached wheel exists, so a recipe that
broke (e.g. a setuptools without ``pkg_resources`` reaching mmcv's setup.py) would stay
hidden on any machine that built it once. This runs the recipe's source preparation and
metadata step in this interpreter's environment, without the 10-17 minute compilation.
"""
import os
import os.path as osp
import subprocess
import sys

import pytest

REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def run(args, **kwargs):
    proc = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          **kwargs)
    return proc.returncode, proc.stdout


@pytest.mark.slow  # unpacks and configures mmcv's source
def test_mmcv_recipe_prepares_and_configures_the_ops_in_this_environment(tmp_path):
    code, out = run(['bash', osp.join(REPO_ROOT, 'tools', 'mmcv_recipe.sh'), 'check',
                     sys.executable, str(tmp_path)], timeout=600)
    assert code == 0, out[-4000:]
    assert 'recipe ok' in out
    # the patched source asks for C++20 (torch >= 2.13 headers)
    setup_py = (tmp_path / 'mmcv-2.1.0' / 'setup.py').read_text()
    assert '-std=c++20' in setup_py and '-std=c++17' not in setup_py


def test_recipe_rejects_unknown_mode(tmp_path):
    code, out = run(['bash', osp.join(REPO_ROOT, 'tools', 'mmcv_recipe.sh'), 'compile',
                     sys.executable, str(tmp_path)], timeout=60)
    assert code == 2 and "valid: prepare, build, check, probe" in out


def test_environment_is_consistent():
    """What tools/install_deps.sh installed satisfies every declared requirement."""
    code, out = run([sys.executable, '-m', 'pip', 'check'], timeout=120)
    assert code == 0, out


def test_installer_rejects_unknown_openvino_switch(tmp_path):
    """MMSLAB_OPENVINO is checked before anything is created or installed."""
    env = dict(os.environ, MMSLAB_OPENVINO='yes', MMSLAB_VENV=str(tmp_path / 'venv'))
    proc = subprocess.run(['bash', osp.join(REPO_ROOT, 'tools', 'install_deps.sh')], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stdout
    assert 'MMSLAB_OPENVINO=yes; valid: 1' in proc.stdout and '0 (without)' in proc.stdout
    assert not (tmp_path / 'venv').exists()


def test_openvino_is_an_optional_extra():
    """setup.cfg keeps OpenVINO and NNCF out of the core requirements (a training-only
    environment installs without them), in the extra that the installer asks for."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(osp.join(REPO_ROOT, 'setup.cfg'))
    core = cfg['options']['install_requires']
    extra = cfg['options.extras_require']['openvino']
    assert 'openvino' not in core and 'nncf' not in core and 'onnxruntime' in core
    assert 'openvino>=' in extra and 'nncf>=' in extra
    installer = open(osp.join(REPO_ROOT, 'tools', 'install_deps.sh')).read()
    assert 'TARGET="$REPO[openvino]"' in installer


def test_missing_openvino_names_the_extra(monkeypatch):
    """Without OpenVINO, opening an OpenVINO model says what to install, not a bare
    ModuleNotFoundError."""
    from mmslab.deploy import runtimes
    monkeypatch.setitem(sys.modules, 'openvino', None)  # import openvino -> ImportError
    with pytest.raises(ImportError, match=r"optional extra 'openvino'.*MMSLAB_OPENVINO=0"):
        runtimes.OpenVINOModel('model.xml')
    with pytest.raises(ImportError, match='OpenVINO is not installed'):
        runtimes.convert_to_openvino('model.onnx', 'out')
    monkeypatch.setitem(sys.modules, 'nncf', None)
    with pytest.raises(ImportError, match="NNCF is not installed.*optional extra 'openvino'"):
        runtimes.import_openvino('nncf')


@pytest.mark.parametrize('args, message', [
    (['--python', '3', '--torch', '2.11.0', '--arch', '9.0'], "--python '3'"),
    (['--python', '3.12', '--torch', 'latest', '--arch', '9.0'], "--torch 'latest'"),
    (['--python', '3.12', '--torch', '2.11.0', '--arch', 'hopper'], "--arch 'hopper'"),
    (['--python', '3.12', '--torch', '2.11.0'], "--arch ''"),
    (['--python', '3.12', '--torch', '2.11.0', '--arch', '9.0', '--gpu'],
     "unknown argument '--gpu'; valid: --python, --torch, --arch"),
])
def test_offline_bundle_refuses_bad_arguments_before_any_work(tmp_path, args, message):
    """tools/offline_bundle.sh names the bad argument and the valid form, and creates
    nothing (no build environment, no download) before its arguments are checked."""
    out_dir = tmp_path / 'bundle'
    code, out = run(['bash', osp.join(REPO_ROOT, 'tools', 'offline_bundle.sh'), *args,
                     '--out', str(out_dir)], timeout=60)
    assert code == 2 and message in out, out
    assert not out_dir.exists()
