"""Rules for the prose inside mmslab's code (docstrings and comments).

* No hardware model names and no speed figures: a comment says what the code does and why;
  measurements, and the machines they were taken on, belong in docs/benchmarks.md, where they
  carry their date and setup and are updated when re-measured.
* Every class that mmslab registers (models, norms, attention kernels, hooks, optimizer
  wrappers) documents each constructor argument in an ``Args:`` section, the way mmdet's
  backbones do: ``embed_dims (int): The feature dimension. Default: 96.``
"""
import ast
import inspect
import io
import os.path as osp
import re
import tokenize
from glob import glob

from conftest import REPO

#: CPU and GPU models. Instruction-set words (AVX-512, VNNI, AMX, avx512_bf16) stay allowed:
#: they explain what code does on which CPUs.
HARDWARE = [
    r'\bEPYC\b', r'\bXeon\b', r'\bRyzen\b', r'\bThreadripper\b', r'\bCore i[3579]\b',
    r'\bCore Ultra\b', r'\b(Sapphire|Emerald|Granite) Rapids\b',
    r'\b(Ice|Cascade|Cooper|Alder|Raptor|Meteor) Lake\b', r'\bSkylake\b',
    r'\b(Genoa|Milan|Bergamo|Turin)\b', r'\bGraviton\d*\b', r'\bApple M[1-4]\b',
    r'\b(G?H|[ABPV])[12]00\b', r'\bA10G?\b', r'\bA[34]0\b', r'\bL40S?\b', r'\b[LT]4\b',
    r'\bRTX\b', r'\bGeForce\b', r'\bTesla\b', r'\bQuadro\b', r'\bMI[123]\d\dX?\b',
    r'\bAMX machine\b',
]

#: Timings, speed ratios and throughputs. ``x`` after a number counts only as a ratio of
#: times: ``56 x 56`` and ``4x nearest-upsampled`` are sizes.
SPEED = [
    r'\d+(\.\d+)?\s*(ms|µs|us|ns|s|sec|secs|seconds|min|minutes)\b',
    r'\d+\.\d+x\b(?!\s+the\s+(tokens|windows|elements|values|memory|channels))',
    r'\d+x\s+(faster|slower|quicker|longer|as\s+(long|fast)|the\s+(time|speed))',
    r'\b(won|wins?|took|takes|ran|runs|speed-?up|faster|slower)\s+(by\s+)?(about\s+|up\s+to\s+)?'
    r'\d+(\.\d+)?(-\d+(\.\d+)?)?x\b',
    r'\d+(\.\d+)?\s*%\s*(faster|slower|longer|shorter|quicker)\b',
    r'\d+\s*(fps|FPS|it/s|img/s|images/s)\b',
]

FIGURES = [re.compile(p) for p in HARDWARE + SPEED]


def mmslab_files():
    return sorted(osp.relpath(p, REPO).replace(osp.sep, '/')
                  for p in glob(osp.join(REPO, 'mmslab', '**', '*.py'), recursive=True))


def prose_blocks(source: str):
    """``(first line, text)`` of each docstring-like string statement (module, class and
    function docstrings, attribute docstrings) and each run of comment lines, as written in
    the file, so that a figure broken over two lines is still one match."""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            yield node.lineno, '\n'.join(lines[node.lineno - 1:node.end_lineno])
    run = None  # [first line, texts]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        if run is not None and run[0] + len(run[1]) == tok.start[0]:
            run[1].append(tok.string.lstrip('#:'))
            continue
        if run is not None:
            yield run[0], '\n'.join(run[1])
        run = [tok.start[0], [tok.string.lstrip('#:')]]
    if run is not None:
        yield run[0], '\n'.join(run[1])


def figure_hits(path: str):
    """``'path:line: match'`` for each hardware name or speed figure in the prose of a file."""
    with open(osp.join(REPO, path), encoding='utf-8') as f:
        source = f.read()
    hits = set()
    for first, text in prose_blocks(source):
        for pattern in FIGURES:
            for m in pattern.finditer(text):
                line = first + text.count('\n', 0, m.start())
                hits.add((line, m.group(0).replace('\n', ' ')))
    return [f'{path}:{line}: {match!r}' for line, match in sorted(hits)]


def test_figure_patterns():
    flagged = ['on an AMD EPYC', 'an Intel Xeon with AMX', 'an H100 at batch 1', 'A100',
               'took 263 -> 226 ms', 'a 1.13x speed-up', 'about 3 ms of onnxruntime',
               'won 3x', '20-70x slower', '11-12 % faster', 'in 3.1 s', 'the AMX machine']
    allowed = ['median_ms', 'timed_ms', 'a 56 x 56 window', 'u8 x s8', '512x512',
               'a 4x nearest-upsampled mask', 'up to 1.2x the tokens', 'on CPUs without VNNI',
               'avx512_bf16 / amx_bf16', 'AVX-512 (no AMX)', 'sm 9.0', '0x1f']
    for text in flagged:
        assert any(p.search(text) for p in FIGURES), text
    for text in allowed:
        assert not [p.pattern for p in FIGURES if p.search(text)], text


def test_no_hardware_names_or_speed_figures_in_code_prose():
    hits = {path: figure_hits(path) for path in mmslab_files()}
    failing = [h for found in hits.values() for h in found]
    assert not failing, (
        'hardware names or speed figures in docstrings / comments (say what the code does and '
        'why; the measurements go to docs/benchmarks.md):\n' + '\n'.join(failing))


# -- Args sections of registered classes ------------------------------------------------------

_ENTRY = re.compile(r'\**(\w+)\s*(\(([^)]*)\))?\s*:')


def args_entries(doc: str) -> dict:
    """name -> ``(type or None, entry text)`` of the ``Args:`` section of a docstring."""
    entries = {}
    lines = inspect.cleandoc(doc or '').splitlines()
    for i, line in enumerate(lines):
        if line.strip() in ('Args:', 'Arguments:'):
            header_indent = len(line) - len(line.lstrip())
            break
    else:
        return entries
    entry_indent, current = None, None
    for line in lines[i + 1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= header_indent:
            break
        if entry_indent is None:
            entry_indent = indent
        if indent == entry_indent:
            m = _ENTRY.match(line.strip())
            current = m and m.group(1)
            if current:
                entries[current] = [m.group(3), line.strip()]
                continue
        if current:
            entries[current][1] += ' ' + line.strip()
    return {name: tuple(value) for name, value in entries.items()}


def registered_classes() -> dict:
    """name -> class of everything mmslab registers (mmslab/registry.py): its own ``MODELS``,
    which holds each model component it also puts into mmdet's and mmseg's, and mmengine's
    root ``HOOKS`` and ``OPTIM_WRAPPERS``, where mmslab's are those its modules define."""
    import mmslab  # noqa: F401  (registers everything)
    from mmslab.registry import HOOKS, MODELS, OPTIM_WRAPPERS
    classes = dict(MODELS.module_dict)
    for registry in (HOOKS, OPTIM_WRAPPERS):
        classes.update((name, cls) for name, cls in registry.module_dict.items()
                       if cls.__module__.split('.')[0] == 'mmslab')
    return classes


def constructor(cls):
    """The class in ``cls``'s MRO whose ``__init__`` builds it, and that ``__init__``'s
    parameters but ``self``: a constructor of ``**kwargs`` only (a preset) hands them on to
    the next one."""
    for klass in cls.__mro__:
        if '__init__' not in vars(klass):
            continue
        params = [p for name, p in inspect.signature(klass.__init__).parameters.items()
                  if name != 'self']
        if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            return klass, params
    return cls, []


def test_registered_classes_found():
    classes = registered_classes()
    for name in ('ReparamSwinTransformer', 'SLABPVT', 'WindowMSA', 'PRepBN', 'UN',
                 'ReparamEvalHook', 'CPUAmpOptimWrapper'):
        assert name in classes, name


def test_registered_classes_document_their_arguments():
    problems = []
    for name, cls in sorted(registered_classes().items()):
        klass, params = constructor(cls)
        path = osp.relpath(inspect.getsourcefile(klass), REPO).replace(osp.sep, '/')
        where = f'{path}:{inspect.getsourcelines(klass)[1]} {name}'
        entries = {}
        for doc in (klass.__init__.__doc__, klass.__doc__, cls.__doc__):
            entries.update(args_entries(doc))
        for extra in sorted(set(entries) - {p.name for p in params}):
            problems.append(f'{where}: Args lists {extra!r}, which the constructor does not take')
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue  # optional: what they forward is documented where it goes
            if p.name not in entries:
                problems.append(f'{where}: argument {p.name!r} is not in the Args section')
                continue
            kind, text = entries[p.name]
            if not kind:
                problems.append(f'{where}: Args entry of {p.name!r} has no (type)')
            if p.default is not p.empty and not re.search(r'\bDefaults?\b', text):
                problems.append(f'{where}: Args entry of {p.name!r} does not give its default')
    assert not problems, '\n'.join(problems)


def test_models_neither_time_nor_read_the_environment():
    """The layers compute the same numbers for the same input in every run: no module of
    mmslab/models imports a timer or reads an environment variable (a hardware-dependent
    choice is an explicit setting)."""
    offenders = []
    for path in sorted(glob(osp.join(REPO, 'mmslab', 'models', '**', '*.py'), recursive=True)):
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ''] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute) and node.attr in ('environ', 'getenv'):
                names = [node.attr]
            if any(n in ('environ', 'getenv', 'time', 'perf_counter') or
                   n.endswith('utils.timing') or n == 'timing' for n in names):
                offenders.append(f'{osp.relpath(path, REPO)}:{node.lineno}')
    assert not offenders, offenders
