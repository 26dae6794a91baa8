"""Commands in the documentation's code blocks name scripts and flags that exist.

Every fenced code block of README.md, docs/*.md and configs/README.md is read; a command that
runs a ``tools/`` or ``benchmarks/`` script must name an existing file, and every ``--flag``
after it (up to a comment or the next command) must be one its parser accepts, read from the
script's ``--help``. A shell wrapper's flags are checked against the Python scripts it runs
(``dist_train.sh`` hands them to ``train.py``).
"""
import functools
import glob
import json
import os
import os.path as osp
import re
import subprocess
import sys

import pytest

from conftest import REPO

DOCS = sorted(['README.md', 'configs/README.md'] +
              [osp.relpath(p, REPO) for p in glob.glob(osp.join(REPO, 'docs', '*.md'))])
SCRIPT = re.compile(r'(?:^|[\s/])((?:tools|benchmarks)/[\w.-]+\.(?:py|sh))')
FLAG = re.compile(r'(?<![\w-])(--[a-zA-Z][\w-]*)')


def commands(text):
    """``(script, flags)`` for each scripted command of the code blocks of Markdown ``text``."""
    for block in re.findall(r'^```[^\n]*\n(.*?)^```', text, re.S | re.M):
        for line in block.replace('\\\n', ' ').splitlines():
            line = line.split(' #', 1)[0]
            for command in re.split(r'&&|\|\||;|\|', line):
                match = SCRIPT.search(command)
                if match:
                    yield match.group(1), FLAG.findall(command[match.end():])


def python_scripts_run_by(script):
    """The Python scripts beside a shell script that it names."""
    names = sorted(set(re.findall(r'\b(\w+)\.py\b', open(osp.join(REPO, script)).read())))
    paths = [osp.join(osp.dirname(script), f'{name}.py') for name in names]
    return [py for py in paths if osp.isfile(osp.join(REPO, py))]


#: Each script's ``--help`` run as ``__main__`` (its own folder first on ``sys.path``, as when
#: run directly), all in one process: one import of torch and mmslab instead of one a script.
HELP_ALL = r"""
import contextlib, io, json, os, runpy, sys
helps = {}
for path in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [path, '--help']
    sys.path.insert(0, os.path.dirname(path))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name='__main__')
        code = 'no exit'
    except SystemExit as e:
        code = e.code or 0
    finally:
        sys.path.pop(0)
    helps[path] = dict(code=code, text=out.getvalue())
print(json.dumps(helps))
"""


@functools.lru_cache(maxsize=None)
def python_help(scripts):
    """``{script: (exit code, text)}`` of ``--help`` for a tuple of Python scripts."""
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, '-c', HELP_ALL, *scripts], cwd=REPO, env=env,
                          text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    helps = json.loads(proc.stdout.strip().splitlines()[-1])
    return {s: (helps[s]['code'], helps[s]['text']) for s in scripts}


def documented_python_scripts():
    """Every Python script the docs run, directly or through a shell script."""
    scripts = {script for doc in DOCS for script, _ in commands(open(osp.join(REPO, doc)).read())
               if osp.isfile(osp.join(REPO, script))}
    return tuple(sorted({py for s in scripts for py in
                         (python_scripts_run_by(s) if s.endswith('.sh') else [s])}))


@functools.lru_cache(maxsize=None)
def accepted_flags(script):
    """The long options of a script: its ``--help`` (Python), or for a shell script those of
    its own ``case`` branches (``--out)``) and of the Python scripts it runs."""
    path = osp.join(REPO, script)
    if script.endswith('.sh'):
        flags = set(re.findall(r'^\s*(--[\w-]+)(?:\|[\w-]+)*\)', open(path).read(), re.M))
        for py in python_scripts_run_by(script):
            flags |= accepted_flags(py)
        return frozenset(flags)
    code, text = python_help(documented_python_scripts())[script]
    assert code == 0, f'{script} --help failed ({code}):\n{text[-2000:]}'
    return frozenset(FLAG.findall(text))


@pytest.mark.slow  # every script's --help (one process importing torch and mmslab)
@pytest.mark.parametrize('doc', DOCS)
def test_documented_commands_exist(doc):
    problems = []
    for script, flags in commands(open(osp.join(REPO, doc)).read()):
        if not osp.isfile(osp.join(REPO, script)):
            problems.append(f'{script}: no such script')
            continue
        unknown = sorted(set(flags) - accepted_flags(script) - {'--help'})
        if unknown:
            problems.append(f'{script}: unknown flags {unknown}')
    assert not problems, f'{doc}: ' + '; '.join(problems)


def test_commands_are_found_with_their_flags():
    text = ('Text `tools/x.py --no`.\n```bash\npython tools/test.py CFG CKPT --latency \\\n'
            '    --out x  # --comment\nbash tools/dist_train.sh C 2 --amp && ls --all\n```\n')
    assert list(commands(text)) == [('tools/test.py', ['--latency', '--out']),
                                    ('tools/dist_train.sh', ['--amp'])]


def test_readme_config_snippet_is_the_real_config():
    """The README's "Use in a config" snippet: its backbone is that of
    configs/mask_rcnn_slab_swin_t_1x.py, every key (out_norm_cfg included), and it names the
    same custom_imports and hooks."""
    from mmengine.config import Config
    text = open(osp.join(REPO, 'README.md')).read()
    block = re.search(r'^## Use in a config\n.*?^```python\n(.*?)^```', text, re.S | re.M)
    assert block, 'README.md has no "Use in a config" python block'
    snippet = {}
    exec(block.group(1), {}, snippet)  # dict(...) literals only
    cfg = Config.fromfile(osp.join(REPO, 'configs', 'mask_rcnn_slab_swin_t_1x.py'))
    assert snippet['model']['backbone'] == cfg.model.backbone.to_dict()
    assert snippet['custom_imports'] == cfg.custom_imports.to_dict()
    assert sorted(h['type'] for h in snippet['custom_hooks']) == \
        sorted(h['type'] for h in cfg.custom_hooks)
