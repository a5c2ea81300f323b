"""The safe encoding of values crossing between the judge and the candidate (stdlib only).

The candidate's side may send any bytes; the judge's `loads` and `decode` only ever build plain
values of known types from them (they call no constructor the sender names), within bounds that
keep the judge's time and memory small whatever the bytes are (an answer past them is
`Unreadable`, and says which bound it broke):
  MAX_REPLY_BYTES per answer, MAX_CONTAINERS lists/dicts/... in it, MAX_DEPTH nesting levels;
  ints of at most MAX_INT_HEX_DIGITS hex digits (a Fraction's parts too: gcd of huge ints is slow);
  at most MAX_SAME_HASH keys of one set or dict with the same hash (ints that all hash alike turn
  building a set quadratic, in C code that no timer interrupts); MAX_NAMEDTUPLE_TYPES classes.
Ints past 2**62 travel as hex (no 4300-digit limit of int <-> str); floats as JSON numbers (NaN
and infinities included). Stdlib subclasses that tests compare by value keep their type where it changes
equality (OrderedDict, Counter, deque, namedtuple as a tuple with its fields); other subclasses of
builtin types travel as their base type. Anything else is an opaque marker that equals nothing.

    JSON array            list
    {"t": [...]}          tuple        {"s": [...]}  set          {"f": [...]}  frozenset
    {"d": [[k, v], ...]}  dict         {"od": ...}   OrderedDict  {"ct": ...}   Counter
    {"dq": [...]}         deque        {"nt": [name, [fields], [values]]}       namedtuple
    {"b": hex}            bytes        {"c": [re, im]} complex    {"I": hex}    int
    {"fr": [n, d]}        Fraction     {"dec": str}  Decimal      {"x": [type name, repr]} opaque
"""

import collections
import decimal
import fractions
from json import dumps as _json_dumps, loads as _json_loads

MAX_MESSAGE_BYTES = 8 << 20  # a request (from the judge, trusted)
MAX_REPLY_BYTES = 4 << 20
MAX_CONTAINERS = 1 << 18
MAX_DEPTH = 100
MAX_INT_HEX_DIGITS = 1 << 14  # 65536 bits, about 19,700 decimal digits
MAX_SAME_HASH = 16
MAX_NAMEDTUPLE_TYPES = 64
_SMALL_INT = 1 << 62


class Unreadable(ValueError):
    """An answer the judge does not read; the message says why (which bound it broke)."""


class Opaque:
    """A value the candidate returned that has no safe encoding (a generator, an instance of its
    own class): it equals nothing but itself, and says what it was."""

    __slots__ = ("type_name", "text")

    def __init__(self, type_name, text):
        self.type_name, self.text = str(type_name), str(text)

    def __repr__(self):
        return "<%s (not transferable from the sandbox): %s>" % (self.type_name, self.text)


class EncodeError(TypeError):
    pass


def encode(value, _depth=0):
    """A JSON-able structure for `value` (raises EncodeError for what cannot be sent)."""
    if _depth > MAX_DEPTH:
        raise EncodeError("value nested too deeply")
    t = type(value)
    if value is None or t is bool or t is str or t is float:
        return value
    if t is int:
        return value if -_SMALL_INT < value < _SMALL_INT else {"I": "%x" % value}
    d = _depth + 1
    if t is list:
        return [encode(v, d) for v in value]
    if t is tuple:
        return {"t": [encode(v, d) for v in value]}
    if t is dict:
        return {"d": [[encode(k, d), encode(v, d)] for k, v in value.items()]}
    if t is set:
        return {"s": [encode(v, d) for v in value]}
    if t is frozenset:
        return {"f": [encode(v, d) for v in value]}
    if t is bytes:
        return {"b": value.hex()}
    if t is complex:
        return {"c": [value.real, value.imag]}
    if isinstance(value, collections.Counter):
        return {"ct": [[encode(k, d), encode(v, d)] for k, v in dict.items(value)]}
    if isinstance(value, collections.OrderedDict):
        return {"od": [[encode(k, d), encode(v, d)] for k, v in dict.items(value)]}
    if isinstance(value, collections.deque):
        return {"dq": [encode(v, d) for v in value]}
    if isinstance(value, tuple) and hasattr(t, "_fields"):
        return {"nt": [t.__name__, [str(f) for f in t._fields], [encode(v, d) for v in tuple.__iter__(value)]]}
    if isinstance(value, fractions.Fraction):
        return {"fr": [encode(value.numerator, d), encode(value.denominator, d)]}
    if isinstance(value, decimal.Decimal):
        return {"dec": str(value)}
    for base in (bool, int, float, str, bytes, complex, tuple, list, dict, set, frozenset):
        if isinstance(value, base):  # any other subclass of a builtin: its base value
            return encode(base(value), _depth)
    raise EncodeError("a value of type %s cannot be sent" % t.__name__)


def encode_result(value):
    """`encode`, falling back to an opaque marker (never raises)."""
    try:
        return encode(value)
    except (EncodeError, RecursionError, ValueError):
        pass
    try:
        name = type(value).__name__
        text = repr(value)[:200]
    except BaseException:
        name, text = "object", "?"
    return {"x": [str(name), str(text)]}


def _few_collisions(keys):
    """`keys`, after checking that no more than MAX_SAME_HASH of them share a hash."""
    counts = {}
    for k in keys:
        h = hash(k)  # (TypeError for an unhashable key, as the set or dict would raise)
        counts[h] = counts.get(h, 0) + 1
        if counts[h] > MAX_SAME_HASH:
            raise Unreadable("a set or dict with more than %d keys of the same hash (building it would take "
                             "time quadratic in its size)" % MAX_SAME_HASH)
    return keys


def _pairs(items, depth):
    if type(items) is not list:
        raise ValueError("malformed pairs")
    out = []
    for kv in items:
        if type(kv) is not list or len(kv) != 2:
            raise ValueError("malformed pair")
        out.append((decode(kv[0], depth), decode(kv[1], depth)))
    _few_collisions([k for k, _ in out])
    return out


def _items(items, depth):
    if type(items) is not list:
        raise ValueError("malformed sequence")
    return [decode(v, depth) for v in items]


_namedtuples = {}


def _namedtuple(name, fields):
    key = (name, tuple(fields))
    if key not in _namedtuples:
        if len(_namedtuples) >= MAX_NAMEDTUPLE_TYPES:
            raise Unreadable("more than %d namedtuple types" % MAX_NAMEDTUPLE_TYPES)
        _namedtuples[key] = collections.namedtuple(name, fields, rename=True)
    return _namedtuples[key]


def _int(body):
    if type(body) is not str:
        raise ValueError("malformed int")
    if len(body) > MAX_INT_HEX_DIGITS:
        raise Unreadable("an int of %d hex digits (about %d decimal digits; the sandbox reads up to %d hex digits)"
                         % (len(body), len(body) * 1.2041, MAX_INT_HEX_DIGITS))
    return int(body, 16)


def decode(obj, _depth=0):
    """The value `obj` (from json.loads) encodes. Raises ValueError (`Unreadable` for a broken
    bound), TypeError or ArithmeticError on anything else."""
    if _depth > MAX_DEPTH:
        raise Unreadable("a value nested deeper than %d levels" % MAX_DEPTH)
    t = type(obj)
    if obj is None or t is bool or t is str or t is int or t is float:
        return obj
    d = _depth + 1
    if t is list:
        return [decode(v, d) for v in obj]
    if t is not dict or len(obj) != 1:
        raise ValueError("malformed value")
    (tag, body), = obj.items()
    if tag == "t":
        return tuple(_items(body, d))
    if tag == "d":
        return dict(_pairs(body, d))
    if tag == "s":
        return set(_few_collisions(_items(body, d)))
    if tag == "f":
        return frozenset(_few_collisions(_items(body, d)))
    if tag == "I":
        return _int(body)
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
        return complex(body[0], body[1])
    if tag == "od":
        return collections.OrderedDict(_pairs(body, d))
    if tag == "ct":
        c = collections.Counter()
        for k, v in _pairs(body, d):
            c[k] = v
        return c
    if tag == "dq":
        return collections.deque(_items(body, d))
    if tag == "nt" and type(body) is list and len(body) == 3:
        name, fields, values = body
        if (type(name) is not str or type(fields) is not list or len(fields) > 255
                or not all(type(f) is str for f in fields)):
            raise ValueError("malformed namedtuple")
        return _namedtuple(name, fields)(*_items(values, d))
    if tag == "fr" and type(body) is list and len(body) == 2:
        n, den = decode(body[0], d), decode(body[1], d)
        if type(n) is not int or type(den) is not int:
            raise ValueError("malformed Fraction")
        return fractions.Fraction(n, den)
    if tag == "dec" and type(body) is str and len(body) < 10000:
        return decimal.Decimal(body)
    if tag == "x" and type(body) is list and len(body) == 2:
        return Opaque(body[0], body[1])
    raise ValueError("malformed value")


# Bound at import, before any program runs: a program that patches `json` (or `os`, `signal`)
# for its own purposes does not break how honest answers travel.
def dumps(message):
    return _json_dumps(message, separators=(",", ":")).encode("utf-8", "surrogatepass")


def loads(data):
    """The JSON in `data`, within MAX_CONTAINERS containers (counted before parsing: brackets in
    strings count too) and the parser's depth; `Unreadable` (saying why) otherwise."""
    containers = data.count(b"[") + data.count(b"{")
    if containers > MAX_CONTAINERS:
        raise Unreadable("more than %d lists, dicts and other containers" % MAX_CONTAINERS)
    try:
        return _json_loads(data.decode("utf-8", "surrogatepass"))
    except RecursionError:
        raise Unreadable("a value nested deeper than %d levels" % MAX_DEPTH)
    except ValueError as e:  # UnicodeDecodeError too
        raise Unreadable("not valid JSON (%s)" % (str(e)[:160],))
