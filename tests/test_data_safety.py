"""The demo data never touches real datasets, and a config whose data holds none of its classes
stops before training.

* ``tools/make_demo_data.py`` (and the ``make_*_demo`` functions, and the data step of
  ``tools/demo.sh`` as written there) refuse, naming the folder, to write where a real COCO or
  ADE20K lies: stand-ins of both, hashed before and after, stay byte-identical with no file
  added, with and without ``--force``, also through a symlink and under an old demo marker.
* The demo root is its own (``data/mmslab_demo``), not the real configs' ``data/coco`` and
  ``data/ade``, in the tool, demo.sh, the demo configs and the GPU check's real-config runs.
* ``check_dataset_classes`` (tools/train.py, before the Runner): the 1x Mask R-CNN config on a
  fresh demo COCO set fails with the annotation file, the classes found and those expected.
"""
import hashlib
import json
import os
import os.path as osp
import re
import shutil
import subprocess
import sys

import pytest
from mmengine.config import Config

from mmslab.datasets import (DEMO_DATA_ROOT, ForeignDataError, coco_demo_complete,
                             make_ade_demo, make_coco_demo)
from mmslab.utils import (DataCheckError, DataNotFoundError, DatasetClassesError,
                          check_dataset_classes)

from conftest import REPO, TOOLS, load_tool

CONFIGS = osp.join(REPO, 'configs')
REAL_DET = osp.join(CONFIGS, 'mask_rcnn_slab_swin_t_1x.py')
REAL_SEG = osp.join(CONFIGS, 'upernet_slab_swin_t_160k_ade20k.py')
DEMO_DET = osp.join(CONFIGS, 'demo', 'mask_rcnn_slab_swin_t_demo.py')
DEMO_SEG = osp.join(CONFIGS, 'demo', 'upernet_slab_swin_t_demo.py')
SMALL = ['--num-train', '2', '--num-val', '2', '--img-size', '64', '--no-progress']

make_demo_data = load_tool('make_demo_data')


# ----------------------------------------------------------------------------------------------
# stand-ins of real datasets
# ----------------------------------------------------------------------------------------------
def write(path, content: bytes) -> None:
    os.makedirs(osp.dirname(path), exist_ok=True)
    with open(path, 'wb') as f:
        f.write(content)


def real_coco(root) -> str:
    """A stand-in of a real COCO at ``root/coco`` (annotations and one image per split)."""
    coco = osp.join(str(root), 'coco')
    categories = [dict(id=1, name='person', supercategory='person')]
    for split, image in (('train', 'x.jpg'), ('val', 'y.jpg')):
        ann = dict(images=[dict(id=1, file_name=image, width=8, height=8)],
                   annotations=[dict(id=1, image_id=1, category_id=1, bbox=[0, 0, 4, 4],
                                     area=16, iscrowd=0)], categories=categories)
        write(osp.join(coco, 'annotations', f'instances_{split}2017.json'),
              json.dumps(ann).encode())
        write(osp.join(coco, f'{split}2017', image), f'real {split} image'.encode())
    return coco


def real_ade(root) -> str:
    """A stand-in of a real ADE20K at ``root/ade/ADEChallengeData2016``."""
    ade = osp.join(str(root), 'ade', 'ADEChallengeData2016')
    for split, stem in (('training', 'ADE_train_00000001'), ('validation', 'ADE_val_00000001')):
        write(osp.join(ade, 'images', split, stem + '.jpg'), f'real {stem}'.encode())
        write(osp.join(ade, 'annotations', split, stem + '.png'), f'labels {stem}'.encode())
    write(osp.join(ade, 'objectInfo150.txt'), b'Idx Ratio Train Val Name\n')
    return osp.join(str(root), 'ade')


def snapshot(root) -> dict:
    """``{path relative to root: sha256 of the file, or 'dir'}`` of everything under ``root``
    (through symlinks: what a writer following them would change)."""
    out = {}
    for parent, dirs, files in os.walk(str(root), followlinks=True):
        rel = osp.relpath(parent, str(root))
        for name in dirs:
            out[osp.join(rel, name)] = 'dir'
        for name in files:
            with open(osp.join(parent, name), 'rb') as f:
                out[osp.join(rel, name)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture
def real_data(tmp_path):
    """``tmp_path/data`` with stand-ins of a real COCO and ADE20K (``coco/``, ``ade/``)."""
    data = tmp_path / 'data'
    real_coco(data)
    real_ade(data)
    return data


def refused(argv, *paths) -> str:
    """Run tools/make_demo_data.py's main; it must stop with every path of ``paths`` named."""
    with pytest.raises(SystemExit) as err:
        make_demo_data.main(argv)
    msg = str(err.value)
    assert msg.startswith('error: refusing'), msg
    for path in paths:
        assert str(path) in msg, msg
    return msg


# ----------------------------------------------------------------------------------------------
# the generator never writes into real data
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize('force', [False, True])
@pytest.mark.parametrize('kind', ['coco', 'ade', 'all'])
def test_make_demo_data_refuses_real_datasets(real_data, kind, force):
    before = snapshot(real_data)
    target = real_data / ('ade' if kind == 'ade' else 'coco')
    msg = refused(['--out', str(real_data), '--kind', kind, *SMALL] + ['--force'] * force,
                  target)
    assert 'demo_info.json' in msg and '--out' in msg, msg
    assert snapshot(real_data) == before


@pytest.mark.parametrize('force', [False, True])
def test_make_demo_data_refuses_an_out_root_of_real_data(real_data, force):
    """``--out data/coco``: the demo would land in ``data/coco/coco``, inside the real set."""
    before = snapshot(real_data)
    for out in (real_data / 'coco', real_data / 'ade'):
        refused(['--out', str(out), *SMALL] + ['--force'] * force, out)
    assert snapshot(real_data) == before


def test_make_demo_data_refuses_a_root_beside_real_data(tmp_path):
    """``--out data`` where data/ holds other datasets: no demo set is put beside them."""
    data = tmp_path / 'data'
    write(str(data / 'cityscapes' / 'leftImg8bit' / 'a.png'), b'real')
    before = snapshot(data)
    refused(['--out', str(data), '--kind', 'coco', *SMALL], data, data / 'cityscapes')
    assert snapshot(data) == before


@pytest.mark.parametrize('force', [False, True])
def test_make_demo_data_refuses_symlinks_into_real_data(tmp_path, real_data, force):
    before = snapshot(real_data)
    # The demo root itself linked to the real sets, as users link data/coco to a shared copy.
    linked = tmp_path / 'linked'
    linked.mkdir()
    os.symlink(real_data / 'coco', linked / 'coco')
    os.symlink(real_data / 'ade', linked / 'ade')
    refused(['--out', str(linked), '--kind', 'coco', *SMALL] + ['--force'] * force,
            linked / 'coco')
    refused(['--out', str(linked), '--kind', 'ade', *SMALL] + ['--force'] * force,
            linked / 'ade')
    # An earlier demo set (with its marker) whose image folder became a link to real images.
    own = tmp_path / 'own'
    make_demo_data.main(['--out', str(own), '--kind', 'coco', *SMALL])
    shutil.rmtree(own / 'coco' / 'train2017')
    os.symlink(real_data / 'coco' / 'train2017', own / 'coco' / 'train2017')
    refused(['--out', str(own), '--kind', 'coco', *SMALL] + ['--force'] * force,
            own / 'coco' / 'train2017')
    assert snapshot(real_data) == before


@pytest.mark.parametrize('force', [False, True])
def test_make_demo_data_refuses_real_data_under_a_demo_marker(tmp_path, real_data, force):
    """A real COCO that an older generator (writing to data/coco) left its marker in: the
    real images there are still not the generator's, so it does not write there."""
    own = tmp_path / 'own'
    make_demo_data.main(['--out', str(own), '--kind', 'coco', *SMALL])
    shutil.copy(own / 'coco' / 'demo_info.json', real_data / 'coco' / 'demo_info.json')
    before = snapshot(real_data)
    msg = refused(['--out', str(real_data), '--kind', 'coco', *SMALL] + ['--force'] * force,
                  real_data / 'coco')
    assert 'x.jpg' in msg or 'y.jpg' in msg, msg  # what was found is named
    assert snapshot(real_data) == before


def test_generators_refuse_real_datasets(real_data):
    before = snapshot(real_data)
    for make, out in ((make_coco_demo, real_data / 'coco'), (make_ade_demo, real_data / 'ade'),
                      (make_ade_demo, real_data / 'coco'), (make_coco_demo, real_data / 'ade')):
        with pytest.raises(ForeignDataError, match=re.escape(str(out))):
            make(str(out), num_train=1, num_val=1, img_size=64, progress=False)
    assert snapshot(real_data) == before


def test_make_demo_data_regenerates_its_own_sets(tmp_path):
    """What the refusals leave allowed: a new root, a complete set (kept, or regenerated with
    --force), an interrupted one (regenerated)."""
    out = tmp_path / 'demo'
    make_demo_data.main(['--out', str(out), *SMALL])
    assert coco_demo_complete(str(out / 'coco'))
    make_demo_data.main(['--out', str(out), '--force', *SMALL])
    marker = out / 'coco' / 'demo_info.json'
    info = json.loads(marker.read_text())
    assert info['complete'] and info['num_train_images'] == 2
    # as an interrupted run leaves it: marked unfinished, some samples gone
    marker.write_text(json.dumps(dict(info, complete=False)))
    os.remove(out / 'coco' / 'val2017' / 'demo_val_000001.jpg')
    assert not coco_demo_complete(str(out / 'coco'))
    make_demo_data.main(['--out', str(out), '--kind', 'coco', *SMALL])
    assert coco_demo_complete(str(out / 'coco'))


# ----------------------------------------------------------------------------------------------
# the demo's own root
# ----------------------------------------------------------------------------------------------
def demo_sh_data_step() -> str:
    """The line of tools/demo.sh that makes the demo data, as written there."""
    with open(osp.join(TOOLS, 'demo.sh')) as f:
        lines = [line.strip() for line in f
                 if 'make_demo_data.py' in line and not line.lstrip().startswith('#')]
    assert len(lines) == 1, lines
    return lines[0]


def test_demo_root_is_not_the_real_datasets_root():
    root = osp.normpath(DEMO_DATA_ROOT)
    assert make_demo_data.parse_args([]).out == DEMO_DATA_ROOT
    assert f'--out {DEMO_DATA_ROOT} ' in demo_sh_data_step()
    for demo, real, sub in ((DEMO_DET, REAL_DET, 'coco'),
                            (DEMO_SEG, REAL_SEG, osp.join('ade', 'ADEChallengeData2016'))):
        demo_cfg, real_cfg = Config.fromfile(demo), Config.fromfile(real)
        for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
            demo_root = osp.normpath(demo_cfg[loader].dataset.data_root)
            real_root = osp.normpath(real_cfg[loader].dataset.data_root)
            assert demo_root == osp.join(root, sub)
            assert real_root == osp.join('data', sub)
    assert Config.fromfile(DEMO_DET).val_evaluator.ann_file.startswith(DEMO_DATA_ROOT + '/')
    assert Config.fromfile(REAL_DET).val_evaluator.ann_file.startswith('data/coco/')


def run_demo_sh_data_step(cwd, kind):
    env = dict(os.environ, PY=sys.executable, REPO=REPO, PYTHONPATH=REPO, DEMO_KIND=kind)
    return subprocess.run(['bash', '-c', 'set -euo pipefail; ' + demo_sh_data_step()], cwd=str(cwd),
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)


@pytest.mark.parametrize('kind', ['coco', 'ade'])
def test_demo_sh_data_step_leaves_real_datasets_alone(tmp_path, real_data, kind):
    """demo.sh's data step, run where data/coco and data/ade are real: it uses (here: keeps a
    small, complete) data/mmslab_demo set, and the real sets stay as they were."""
    make = make_coco_demo if kind == 'coco' else make_ade_demo
    demo = tmp_path / DEMO_DATA_ROOT / kind
    make(str(demo), num_train=2, num_val=1, img_size=64, progress=False)

    def real_sets():  # data/ holds the demo root too: only the real sets are compared
        return {name: snapshot(real_data / name) for name in ('coco', 'ade')}

    before, demo_before = real_sets(), snapshot(demo)
    proc = run_demo_sh_data_step(tmp_path, kind)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f'already present in {DEMO_DATA_ROOT}/{kind}' in proc.stdout, proc.stdout[-3000:]
    assert real_sets() == before and snapshot(demo) == demo_before
    # The demo root linked to the real set by mistake: the same step refuses, names it.
    shutil.rmtree(demo)
    os.symlink(real_data / kind, demo)
    proc = run_demo_sh_data_step(tmp_path, kind)
    assert proc.returncode != 0
    assert 'refusing to write the synthetic' in proc.stdout, proc.stdout[-3000:]
    assert f'{DEMO_DATA_ROOT}/{kind}' in proc.stdout, proc.stdout[-3000:]
    assert 'Traceback' not in proc.stdout, proc.stdout[-3000:]
    assert real_sets() == before


def test_gpu_check_trains_the_real_configs_on_the_demo_root(tmp_path, monkeypatch):
    """tools/gpu_check.py trains the real configs on the synthetic sets: at the demo root (not
    the real data/coco and data/ade) and with the demo classes, so the pre-training check
    passes on freshly made demo data."""
    gpu_check = load_tool('gpu_check')
    monkeypatch.chdir(tmp_path)
    make_demo_data.main(SMALL)
    for config in (REAL_DET, REAL_SEG):
        path = gpu_check.synthetic_config(osp.relpath(config, REPO), 2, str(tmp_path / 'work'))
        cfg = Config.fromfile(path)
        for loader in ('train_dataloader', 'val_dataloader'):
            assert cfg[loader].dataset.data_root.startswith(DEMO_DATA_ROOT + '/')
        if cfg.default_scope == 'mmdet':
            assert cfg.val_evaluator.ann_file.startswith(DEMO_DATA_ROOT + '/')
        check_dataset_classes(cfg, 'train', path)


# ----------------------------------------------------------------------------------------------
# a dataset without the config's classes stops before training
# ----------------------------------------------------------------------------------------------
def on_data_root(config, data_root) -> Config:
    """``config`` with its train / val / test datasets (and COCO evaluator) at ``data_root``."""
    cfg = Config.fromfile(config)
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        cfg[loader].dataset.data_root = data_root
    if cfg.default_scope == 'mmdet':
        for evaluator in ('val_evaluator', 'test_evaluator'):
            cfg[evaluator].ann_file = osp.join(data_root, 'annotations',
                                               'instances_val2017.json')
    return cfg


@pytest.fixture(scope='module')
def demo_coco(tmp_path_factory):
    """A fresh small demo COCO set, made by the tool: ``<root>/coco``."""
    root = tmp_path_factory.mktemp('demo')
    make_demo_data.main(['--out', str(root), '--kind', 'coco', *SMALL])
    return str(root / 'coco')


def test_real_config_on_the_demo_set_stops_before_training(demo_coco):
    cfg = on_data_root(REAL_DET, demo_coco)
    with pytest.raises(DatasetClassesError) as err:
        check_dataset_classes(cfg, 'train', REAL_DET)
    msg = str(err.value)
    ann_file = osp.join(demo_coco, 'annotations', 'instances_train2017.json')
    assert ann_file in msg, msg
    assert 'circle, square, triangle, star, hexagon, cross' in msg, msg  # found
    assert 'person, bicycle, car' in msg and '80' in msg, msg  # expected: mmdet's COCO classes
    assert 'CocoDataset' in msg and 'configs/demo/' in msg, msg
    # the demo config on the same set: no complaint
    check_dataset_classes(on_data_root(DEMO_DET, demo_coco), 'train', DEMO_DET)


@pytest.mark.slow  # tools/train.py in a subprocess
def test_train_tool_stops_the_real_config_on_the_demo_set(demo_coco, tmp_path):
    """Without the check, mmengine's ``need at least one array to concatenate`` came after the
    model was built; now train.py stops first, with the file and the classes."""
    ann = osp.join(demo_coco, 'annotations', 'instances_val2017.json')
    options = [f'{loader}.dataset.data_root={demo_coco}/'
               for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    options += [f'val_evaluator.ann_file={ann}', f'test_evaluator.ann_file={ann}']
    proc = subprocess.run(
        [sys.executable, osp.join(TOOLS, 'train.py'), REAL_DET, '--work-dir',
         str(tmp_path / 'work'), '--cfg-options', *options],
        cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode != 0
    out = proc.stdout
    assert 'instances_train2017.json' in out and 'circle' in out and 'person' in out, out[-3000:]
    assert 'Traceback' not in out and 'need at least one array' not in out, out[-3000:]
    assert not (tmp_path / 'work').exists()  # stopped before the Runner made its work dir


def test_dataset_classes_check_cases(tmp_path, demo_coco):
    root = tmp_path / 'coco'
    shutil.copytree(demo_coco, root)
    ann = root / 'annotations' / 'instances_train2017.json'
    # Both splits without annotations of 'circle' (category 1).
    for split in ('train', 'val'):
        path = root / 'annotations' / f'instances_{split}2017.json'
        coco = json.loads(path.read_text())
        kept = [a for a in coco['annotations'] if a['category_id'] != 1]
        path.write_text(json.dumps(dict(coco, annotations=kept)))
    names = {c['id']: c['name'] for c in coco['categories']}
    # The config's classes are among the file's categories, but no annotation is of them.
    cfg = on_data_root(DEMO_DET, str(root))
    cfg.train_dataloader.dataset.metainfo = dict(classes=('circle', 'dodecagon'))
    with pytest.raises(DatasetClassesError, match='none of its .* annotations'):
        check_dataset_classes(cfg, 'train')
    # A validation set (test_mode) needs only the classes, not annotations of them.
    annotated = names[json.loads(ann.read_text())['annotations'][0]['category_id']]
    cfg.train_dataloader.dataset.metainfo = dict(classes=(annotated, ))
    cfg.val_dataloader.dataset.metainfo = dict(classes=('circle', ))
    check_dataset_classes(cfg, 'train')
    # No overlap: named with the classes of the config's metainfo.
    cfg.val_dataloader.dataset.metainfo = dict(classes=('person', ))
    with pytest.raises(DatasetClassesError, match=r"(?s)val_dataloader.*from metainfo\.classes"
                       r"\): person"):
        check_dataset_classes(cfg, 'train')
    # Not JSON, and a missing file: clear errors naming the file.
    ann.write_text('{not json')
    with pytest.raises(DataCheckError, match=re.escape(str(ann))):
        check_dataset_classes(cfg, 'train')
    os.remove(ann)
    with pytest.raises(DataNotFoundError, match=re.escape(str(ann))):
        check_dataset_classes(cfg, 'train')


def test_dataset_classes_check_empty_ade_folder(tmp_path):
    root = tmp_path / 'ade' / 'ADEChallengeData2016'
    for sub in ('images', 'annotations'):
        for split in ('training', 'validation'):
            (root / sub / split).mkdir(parents=True)
    cfg = on_data_root(REAL_SEG, str(root))
    with pytest.raises(DataNotFoundError) as err:
        check_dataset_classes(cfg, 'train', REAL_SEG)
    assert str(root / 'images' / 'training') in str(err.value)
    make_ade_demo(str(tmp_path / 'demo'), num_train=1, num_val=1, img_size=64, progress=False)
    check_dataset_classes(on_data_root(REAL_SEG, str(tmp_path / 'demo' / 'ADEChallengeData2016')),
                          'train', REAL_SEG)
