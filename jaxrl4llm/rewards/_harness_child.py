"""The part of an assert-style test run that goes into the sandbox (rewards/harness.py).

This file's source is appended to the program and the test's setup, followed by one call,
`_jaxrl4llm_harness(HOLES, MARK, globals())`: it evaluates each hole (an expression of the
test that calls the program, with no expected value in it) in the program's namespace and
writes the values, encoded, as one line after MARK on fd 1, then exits at once.

Nothing here is trusted: the program runs first and may replace any of it. What it sends is
data that the trusted side decodes into plain values (never objects of the program's classes)
and compares itself, so a forged line can only claim values the program could have returned.
Standard library only (the sandbox has no site-packages); imports stay inside the functions
and every name starts with `_jaxrl4llm_`, so appending this file changes none of the program's
names.
"""


def _jaxrl4llm_tagged(value, encode):
    """The tagged form of a value that is not None, a bool or an exact str."""
    if isinstance(value, int):
        return ["int", hex(int.__index__(value))]
    if isinstance(value, float):
        return ["float", float.hex(value)]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, complex):
        return ["complex", float.hex(value.real), float.hex(value.imag)]
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", bytes(value).hex()]
    for kind in (list, tuple, frozenset, set):
        if isinstance(value, kind):
            return [kind.__name__, [encode(item) for item in value]]
    if isinstance(value, dict):
        return ["dict", [[encode(k), encode(v)] for k, v in dict.items(value)]]
    return _jaxrl4llm_library_value(value, encode)


def _jaxrl4llm_library_value(value, encode):
    """range, Fraction, Decimal and iterators (generators, map, zip: their items)."""
    kind = type(value)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(value, range):
        return ["range", hex(value.start), hex(value.stop), hex(value.step)]
    if name == "fractions.Fraction":
        return ["fraction", hex(value.numerator), hex(value.denominator)]
    if name == "decimal.Decimal":
        return ["decimal", str(value)]
    if hasattr(kind, "__next__") and hasattr(kind, "__iter__"):
        return ["iter", [encode(item) for item in value]]
    raise TypeError(f"a value of type {name} cannot leave the sandbox")


def _jaxrl4llm_json(value, quote):
    """JSON of an encoded value (None, bools, strs and lists only), without importing json
    (its import, through re and enum, costs ~10 ms a run)."""
    if value is None or value is True or value is False:
        return {None: "null", True: "true", False: "false"}[value]
    if type(value) is str:
        return quote(value)
    return "[" + ",".join(_jaxrl4llm_json(item, quote) for item in value) + "]"


def _jaxrl4llm_harness(holes, mark, namespace):
    import os

    try:
        from _json import encode_basestring_ascii as quote
    except ImportError:
        from json.encoder import encode_basestring_ascii as quote

    def encode(value):
        if value is None or type(value) in (bool, str):
            return value
        return _jaxrl4llm_tagged(value, encode)

    found = []
    for text in holes:
        try:
            found.append(["ok", encode(eval(compile(text, "<test>", "eval"), namespace))])
        except Exception as exc:  # noqa: BLE001 - the test's failure, reported by name
            found.append(["raised", f"{type(exc).__name__}: {exc}"[:200]])
    data = (mark + _jaxrl4llm_json(found, quote) + "\n").encode()
    while data:
        data = data[os.write(1, data) :]
    os._exit(0)
