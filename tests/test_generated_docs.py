"""The benchmark tables of README.md and docs/ are what benchmarks/make_tables.py generates from
benchmarks/results/*.json, and every results file says where its figures came from."""
import glob
import importlib.util
import json
import os.path as osp

import pytest

from conftest import REPO


def load_make_tables():
    spec = importlib.util.spec_from_file_location(
        'make_tables', osp.join(REPO, 'benchmarks', 'make_tables.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_tables = load_make_tables()
RESULTS = sorted(glob.glob(osp.join(REPO, 'benchmarks', 'results', '*.json')))


@pytest.mark.parametrize('doc', make_tables.DOCS)
def test_committed_docs_equal_the_generated_tables(doc):
    with open(osp.join(REPO, doc)) as f:
        text = f.read()
    assert text == make_tables.render(text), (
        f'{doc} differs from benchmarks/results/: run python benchmarks/make_tables.py')


def test_every_block_is_placed_once():
    """Each generated block sits in exactly one doc, once; README.md holds the model table."""
    found = {}
    for doc in make_tables.DOCS:
        with open(osp.join(REPO, doc)) as f:
            for name, _ in make_tables.MARKER.findall(f.read()):
                found.setdefault(name, []).append(doc)
    assert {name: docs for name, docs in found.items() if len(docs) > 1} == {}
    assert sorted(found) == sorted(make_tables.BLOCKS)
    assert found['model-table'] == ['README.md']


def test_unknown_block_is_an_error():
    with pytest.raises(KeyError, match='no-such-table'):
        make_tables.render('<!-- no-such-table:begin -->\nx\n<!-- no-such-table:end -->\n')


@pytest.mark.parametrize('path', RESULTS, ids=[osp.basename(p) for p in RESULTS])
def test_results_say_where_they_came_from(path):
    """Every run has its command, machine and date; figures copied from earlier docs say so."""
    name = osp.splitext(osp.basename(path))[0]
    data = make_tables.load(name)
    assert data['runs'], path
    for run in data['runs']:
        for key in ('command', 'machine', 'date'):
            assert run.get(key), f'{path}: a run without {key!r}'
        if 'source' in run:
            assert run['source'].startswith('transcribed from '), path
    with open(path) as f:
        raw = json.load(f)
    assert isinstance(raw, dict)


def test_model_table_has_a_row_per_preset_with_configs():
    """One row per preset; the configs column names only variants that have configs."""
    table = make_tables.block_model_table()
    for name, variant, _ in make_tables.PRESETS:
        row = [line for line in table.splitlines() if line.startswith(f'| {name} |')]
        assert len(row) == 1, name
        if variant:
            assert glob.glob(osp.join(REPO, 'configs', f'mask_rcnn_{variant}_1x.py')), variant
            assert f'`{variant}`' in row[0]


def train_report(device: str) -> dict:
    """A report in tools/benchmark_train.py's format."""
    def spread(median, low, high):
        return dict(median=median, min=low, max=high)
    models = {
        'mask_rcnn_swin_t_1x': dict(step_ms=spread(900.0, 880.0, 950.0), times_ms=[900.0],
                                    vs_reference=spread(1.0, 1.0, 1.0),
                                    vs_mmdet_swin=spread(1.1, 1.05, 1.2)),
        'mask_rcnn_repa_swin_t_1x': dict(step_ms=spread(700.0, 690.0, 760.0),
                                         times_ms=[700.0],
                                         vs_reference=spread(1.29, 1.2, 1.33),
                                         vs_mmdet_swin=spread(1.41, 1.3, 1.5)),
        'mmdet Swin-T': dict(step_ms=spread(990.0, 970.0, 1010.0), times_ms=[990.0],
                             vs_reference=spread(0.91, 0.9, 0.95)),
    }
    if device == 'cuda':
        for row in models.values():
            row['peak_memory_gib'] = 3.25
    return dict(part='backbone', shape=[800, 1216], batch=2, precision='fp32', device=device,
                timing='perf_counter', repeat=10, warmup=2, threads=2, prepbn_progress=0.5,
                configs=['configs/mask_rcnn_swin_t_1x.py'], reference='mask_rcnn_swin_t_1x',
                mmdet_swin='mmdet Swin-T', machine=dict(cpu='Some CPU', isa='avx512',
                                                        blas='mkl', torch_threads=2),
                torch='2.14.1', models=models, command='python tools/benchmark_train.py '
                '--out work_dirs/train_speed', date='2026-01-01')


def test_training_blocks_render_benchmark_train_results(tmp_path, monkeypatch):
    """A tools/benchmark_train.py JSON saved as <machine>-benchmark_train.json is rendered
    in the CPU or the GPU block by its device; without one, the blocks say so."""
    monkeypatch.setattr(make_tables, 'RESULTS', str(tmp_path))
    assert 'No training-step results' in make_tables.training_block('cpu')
    (tmp_path / 'some-cpu-benchmark_train.json').write_text(json.dumps(train_report('cpu')))
    (tmp_path / 'some-gpu-benchmark_train.json').write_text(json.dumps(dict(
        tool='tools/benchmark_train.py', machine_label='Some GPU',
        runs=[train_report('cuda')])))
    cpu = make_tables.training_block('cpu')
    assert '| mask_rcnn_repa_swin_t_1x | 700.0 (690-760) | 1.29 [1.20-1.33] | 1.41 [1.30-1.50] |' \
        in cpu
    assert 'Some CPU (avx512, mkl), 2 threads' in cpu and 'peak memory' not in cpu
    assert 'Command: `python tools/benchmark_train.py --out work_dirs/train_speed`' in cpu
    gpu = make_tables.training_block('cuda')
    assert '**Some GPU**' in gpu and '| 3.25 |' in gpu and 'Some CPU' not in gpu.split('\n')[0]
