"""What a replayed cell may call: the tables behind :mod:`nbfleet.kernel.purity`.

Replay on resume is an allowlist, not a denylist: a denylist of "bad" calls is
never complete (there is always one more way to write a file), while a cell that
only calls what is listed here cannot reach the file system for writing, the
network or a process. Every entry is something that only builds a value in the
kernel's own memory, reads (never writes) a file, or waits.

Values are tracked by *kind*; each kind says which of its attributes and methods a
replay may use. ``data`` is the kind of every inert built-in value (numbers,
strings, containers, arrays); by construction no module, file handle opened for
writing or unvetted function ever has it, so its methods (``list.remove``,
``str.replace`` ...) cannot do harm however they are named.
"""

from __future__ import annotations

import builtins
import collections
import re
import types

Kind = str

DATA: Kind = "data"
STR: Kind = "str"  # data known to be a str or bytes: what open() accepts as a name
FILE: Kind = "file"  # a file opened for reading only
LOCK: Kind = "lock"
PATTERN: Kind = "pattern"
MEMIO: Kind = "memio"  # io.StringIO / io.BytesIO: writes stay in memory
RNG: Kind = "rng"
QUEUE: Kind = "queue"
CM: Kind = "cm"  # contextlib.suppress / nullcontext
CALLABLE: Kind = "callable"  # safe to call with any arguments: vetted code, pure built-ins
MIXED: Kind = "mixed"  # one of several value kinds: may be passed around, nothing more
POISON: Kind = "poison"  # a module or an argument-checked function mixed with others
MODULE = "module:"  # + dotted module name; only ever the root of an attribute chain
FN = "fn:"  # + dotted name of an entry of SAFE_CALLS

#: Callables whose safety depends on their arguments; the analyzer checks each call
#: and refuses to let them be used as plain values (``map(open, names, modes)``).
ARGUMENT_CHECKED = frozenset({"builtins.open", "io.open", "builtins.print"})

_STR_BUILTINS = "ascii bin chr format hex oct repr str"
_DATA_BUILTINS = (
    "abs all any bool bytearray bytes callable complex dict divmod enumerate filter float "
    "frozenset hash id int isinstance issubclass iter len list map max min next object ord "
    "pow range reversed round set slice sorted sum tuple zip print"
)

#: Exceptions a replay may catch; these four would let a replay swallow the
#: timeout that stops it (the deadline raises a BaseException).
UNCATCHABLE = frozenset({"BaseException", "KeyboardInterrupt", "SystemExit", "GeneratorExit"})


def _exceptions() -> dict[str, Kind]:
    return {f"builtins.{name}": DATA for name, value in vars(builtins).items()
            if isinstance(value, type) and issubclass(value, Exception)}


def _table(module: str, names: str, kind: Kind) -> dict[str, Kind]:
    return {f"{module}.{name}": kind for name in names.split()}


#: Dotted name -> the kind of what calling it returns.
SAFE_CALLS: dict[str, Kind] = {
    **_exceptions(),
    **_table("builtins", _STR_BUILTINS, STR),
    **_table("builtins", _DATA_BUILTINS, DATA),
    "builtins.open": FILE,
    "io.open": FILE,
    **_table("io", "StringIO BytesIO", MEMIO),
    **_table("threading", "Lock RLock Event Condition Semaphore BoundedSemaphore", LOCK),
    "re.compile": PATTERN,
    **_table("re", "match search fullmatch findall finditer split subn", DATA),
    **_table("re", "sub escape", STR),
    **_table("itertools", "count cycle repeat chain islice accumulate compress dropwhile "
             "filterfalse groupby pairwise starmap takewhile tee zip_longest product "
             "permutations combinations combinations_with_replacement batched", DATA),
    "itertools.chain.from_iterable": DATA,
    **_table("collections", "deque Counter OrderedDict defaultdict ChainMap", DATA),
    "collections.namedtuple": CALLABLE,
    **_table("functools", "partial cmp_to_key", CALLABLE),
    "functools.reduce": DATA,
    "operator.itemgetter": CALLABLE,
    **_table("operator", "add sub mul truediv floordiv mod neg pos abs eq ne lt le gt ge "
             "not_ truth contains getitem concat", DATA),
    **_table("math", "acos acosh asin asinh atan atan2 atanh ceil comb copysign cos cosh "
             "degrees dist erf erfc exp expm1 fabs factorial floor fmod frexp fsum gamma gcd "
             "hypot isclose isfinite isinf isnan isqrt lcm ldexp lgamma log log10 log1p log2 "
             "modf nextafter perm pow prod radians remainder sin sinh sqrt tan tanh trunc ulp",
             DATA),
    **_table("time", "sleep time monotonic perf_counter time_ns monotonic_ns "
             "perf_counter_ns gmtime localtime", DATA),
    "time.strftime": STR,
    "random.Random": RNG,
    "json.loads": DATA,
    "json.dumps": STR,
    **_table("datetime", "datetime date time timedelta timezone datetime.now "
             "datetime.fromisoformat datetime.fromtimestamp date.today date.fromisoformat",
             DATA),
    "decimal.Decimal": DATA,
    "fractions.Fraction": DATA,
    **_table("copy", "copy deepcopy", DATA),
    **_table("heapq", "heappush heappop heapify heappushpop heapreplace nlargest nsmallest "
             "merge", DATA),
    **_table("bisect", "bisect bisect_left bisect_right insort insort_left insort_right",
             DATA),
    **_table("queue", "Queue LifoQueue PriorityQueue SimpleQueue", QUEUE),
    **_table("contextlib", "suppress nullcontext", CM),
    **_table("os.path", "join basename dirname normpath abspath relpath expanduser "
             "commonpath", STR),
    **_table("os.path", "splitext split exists isfile isdir isabs getsize", DATA),
    "os.fspath": STR,
    **_table("statistics", "mean median mode stdev variance pstdev pvariance fmean", DATA),
    **_table("textwrap", "dedent indent fill shorten", STR),
    "textwrap.wrap": DATA,
    **_table("numpy", "array asarray arange zeros ones empty full linspace eye zeros_like "
             "ones_like full_like concatenate stack", DATA),
}

#: Modules a replayed cell may import (importing them changes nothing outside the
#: kernel); what it then calls through them is still checked against SAFE_CALLS.
IMPORTABLE = frozenset({
    "bisect", "cmath", "collections", "contextlib", "copy", "datetime", "decimal",
    "fractions", "functools", "heapq", "io", "itertools", "json", "math", "numpy",
    "operator", "os", "os.path", "queue", "random", "re", "statistics", "string",
    "textwrap", "threading", "time", "typing",
})

#: Modules known under another name at run time (``os.system.__module__`` is posix).
MODULE_ALIASES = {"posixpath": "os.path", "ntpath": "os.path", "posix": "os", "nt": "os",
                  "_io": "io", "_socket": "socket", "_thread": "threading"}


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


def _public(*kinds: type) -> frozenset[str]:
    return frozenset(name for kind in kinds for name in dir(kind) if not name.startswith("_"))


_DATA_ATTRS = _public(str, bytes, bytearray, list, tuple, dict, set, frozenset, int, float,
                      complex, range, slice, re.Match, collections.deque,
                      collections.Counter, collections.OrderedDict) | {"send", "throw", "close"}

#: Kind -> the attributes (methods included) a replay may use on a value of it.
ATTRIBUTES: dict[Kind, frozenset[str]] = {
    DATA: _DATA_ATTRS,
    STR: _DATA_ATTRS,
    FILE: _words("read readline readlines seek tell close closed name mode encoding errors "
                 "newlines readable seekable writable isatty"),
    LOCK: _words("acquire release locked set clear is_set wait notify notify_all"),
    PATTERN: _words("match search fullmatch findall finditer split sub subn pattern flags "
                    "groups groupindex"),
    MEMIO: _words("read readline readlines write writelines getvalue seek tell truncate "
                  "close closed"),
    RNG: _words("random randint randrange choice choices shuffle sample uniform gauss "
                "normalvariate getrandbits seed"),
    QUEUE: _words("put get put_nowait get_nowait qsize empty full task_done"),
}

#: Methods whose result is a string when the receiver is one (for open()'s name).
STR_METHODS = _words(
    "strip lstrip rstrip upper lower title capitalize casefold replace format join center "
    "ljust rjust zfill removeprefix removesuffix expandtabs swapcase translate encode decode "
    "format_map read readline")

#: Context managers a replay may enter: they only touch the kernel's own memory
#: (a lock) or a file opened for reading.
CONTEXT_KINDS = frozenset({FILE, LOCK, MEMIO, CM})

_FILES = frozenset({"os", "shutil", "pathlib", "tempfile", "glob", "fileinput", "io",
                    "builtins.open", "sqlite3", "pickle", "shelve", "zipfile", "tarfile"})
_PROCESSES = frozenset({"subprocess", "multiprocessing", "pty", "signal", "concurrent",
                        "asyncio", "threading"})
_NETWORK = frozenset({"socket", "ssl", "urllib", "urllib3", "http", "requests", "httpx",
                      "aiohttp", "ftplib", "smtplib", "poplib", "imaplib", "telnetlib",
                      "websocket", "websockets", "paramiko", "boto3", "botocore"})
_ANY_CODE = frozenset({"builtins.exec", "builtins.eval", "builtins.compile",
                       "builtins.__import__", "builtins.breakpoint", "builtins.input",
                       "importlib.import_module", "runpy.run_path", "runpy.run_module"})
_REFLECTION = frozenset({"builtins.getattr", "builtins.setattr", "builtins.delattr",
                         "builtins.hasattr", "builtins.vars", "builtins.globals",
                         "builtins.locals", "builtins.dir", "builtins.type", "builtins.super",
                         "operator.attrgetter", "operator.methodcaller"})
_OS_PROCESSES = ("os.system", "os.popen", "os.spawn", "os.exec", "os.fork", "os.kill",
                 "os.posix_spawn", "os.startfile")


def why_not(dotted: str) -> str:
    """Why calling ``dotted`` makes a cell unsafe to re-run, phrased to follow
    "the cell that made it ..."."""
    short = dotted.removeprefix("builtins.")
    top = dotted.split(".")[0]
    if dotted in _ANY_CODE:
        return f"calls {short}, which can run any code"
    if dotted in _REFLECTION:
        return f"calls {short}, which can reach any object"
    if dotted.startswith(_OS_PROCESSES) or top in _PROCESSES:
        return f"starts processes or threads (calls {short})"
    if top in _NETWORK:
        return f"uses the network (calls {short})"
    if top in _FILES or dotted in _FILES:
        return f"may write files (calls {short})"
    return f"calls {short}, which is not known to be free of side effects"


def module_name(module: types.ModuleType | str) -> str:
    """The name users know a module by."""
    name = module if isinstance(module, str) else module.__name__
    return MODULE_ALIASES.get(name, name)
