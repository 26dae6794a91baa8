"""Smoke tests of the measurement tools (they print figures; nothing here asserts a speed)."""
import json
import os.path as osp

import pytest
from conftest import load_script


TINY_CFG = '''
default_scope = 'mmseg'
model = dict(
    type='EncoderDecoder', data_preprocessor=dict(type='SegDataPreProcessor'),
    backbone=dict(type='RePaSwin', embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                  window_size=4, drop_path_rate=0.0, norm_cfg=dict(type='PRepBN', step=5)),
    decode_head=dict(type='FCNHead', in_channels=128, in_index=3, channels=8, num_convs=1,
                     num_classes=4, norm_cfg=dict(type='BN'), align_corners=False,
                     loss_decode=dict(type='CrossEntropyLoss')),
    test_cfg=dict(mode='whole'))
'''


@pytest.fixture()
def tiny_config(tmp_path):
    path = tmp_path / 'tiny_repa.py'
    path.write_text(TINY_CFG)
    return str(path)


def test_benchmark_tool_writes_json_and_plot(tiny_config, tmp_path):
    report = load_script('tools/benchmark.py').main(
        [tiny_config, '--shapes', '64x64', '48x80', '--repeat', '2', '--warmup', '0',
         '--baseline', tiny_config, '--out', str(tmp_path / 'bench')])
    with open(tmp_path / 'bench' / 'benchmark.json') as f:
        saved = json.load(f)
    assert saved['ratios'] == report['ratios']
    variants = {r['variant'] for r in saved['results']}
    assert variants == {'tiny_repa (fused)', 'tiny_repa (unfused)', 'tiny_repa'}
    assert {r['part'] for r in saved['results']} == {'backbone', 'model'}
    assert all(r['median_ms'] > 0 and r['repeats'] == 2 for r in saved['results'])
    assert len(saved['ratios']) == 2 * 2 * 2  # 2 other variants x 2 parts x 2 shapes
    assert osp.getsize(tmp_path / 'bench' / 'benchmark.png') > 1000
    # the CPU and the window-softmax implementation chosen by measurement are recorded
    assert saved['machine']['cpu'] and saved['machine']['blas']
    assert saved['window_softmax'], 'a window-attention model was timed: a choice is recorded'
    assert {c['impl'] for c in saved['window_softmax'].values()} <= {'sdpa', 'matmul'}


def test_benchmark_tool_times_compiled_fused_backbone_next_to_eager(tiny_config, tmp_path):
    # dynamo's eager backend: the graphs are counted and timed, nothing is code-generated
    import torch._dynamo
    torch._dynamo.reset()  # no automatic-dynamic state from an earlier compilation
    report = load_script('tools/benchmark.py').main(
        [tiny_config, '--shapes', '64x64', '128x128', '96x96', '--parts', 'backbone',
         '--repeat', '1', '--warmup', '0', '--compile', '--compile-backend', 'eager',
         '--out', str(tmp_path / 'bench')])
    compiled = 'tiny_repa (fused, torch.compile)'
    assert {r['variant'] for r in report['results']} == {
        'tiny_repa (fused)', 'tiny_repa (unfused)', compiled}
    runs = report['compile']['first_calls']
    assert [r['shape'] for r in runs] == [[64, 64], [128, 128], [96, 96]]
    assert all(r['variant'] == compiled and r['eager_variant'] == 'tiny_repa (fused)'
               for r in runs)
    assert all(r['median_ms'] > 0 and r['eager_median_ms'] > 0 and r['first_call_s'] > 0
               for r in runs)
    # a static graph, one dynamic graph at the second size, none after: no per-stage graphs
    assert [r['graphs_compiled'] for r in runs] == [1, 1, 0]
    with open(tmp_path / 'bench' / 'benchmark.json') as f:
        assert json.load(f)['compile']['backend'] == 'eager'


def test_benchmark_rejects_bad_shapes(tiny_config, tmp_path):
    with pytest.raises(ValueError, match='HEIGHTxWIDTH'):
        load_script('tools/benchmark.py').main(
            [tiny_config, '--shapes', '64by64', '--out', str(tmp_path)])


def test_analyze_model_counts_fewer_parameters_after_fusion(tiny_config, tmp_path):
    out = tmp_path / 'complexity.json'
    result = load_script('tools/analyze_model.py').main(
        [tiny_config, '--shape', '64', '64', '--out', str(out)])
    assert result['fused']['params'] < result['unfused']['params']
    assert 0 < result['fused']['flops'] < result['unfused']['flops']
    assert json.loads(out.read_text())['params_ratio'] == pytest.approx(result['params_ratio'])
