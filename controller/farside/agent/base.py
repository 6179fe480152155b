"""The agent's start: stdlib modules imported on first use, and json through its C accelerator."""



class _Lazy:
    """A module imported on its first use. An agent start that only says hello or polls (`ctl ping`, `ctl status`)
    needs none of these, and they were half of its start: hashlib alone loads OpenSSL (~9 ms), subprocess,
    shutil, tarfile and traceback another ~12 ms; a cold `ctl ping` of 40 containers starts 40 agents."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        module = __import__(self._name)
        globals()[self._name] = module
        return getattr(module, attr)


hashlib = _Lazy("hashlib")
re = _Lazy("re")
glob = _Lazy("glob")
shutil = _Lazy("shutil")
subprocess = _Lazy("subprocess")
tarfile = _Lazy("tarfile")
traceback = _Lazy("traceback")


try:  # the interpreter's own sha256, for a few KiB: hashlib would load OpenSSL for them (see _Lazy)
    from _sha256 import sha256 as _small_sha256
except ImportError:
    try:
        from _sha2 import sha256 as _small_sha256  # Python 3.12+
    except ImportError:
        _small_sha256 = None


class _Json:
    """json's loads/dumps/load/dump. The json module imports re and enum (~5 ms of CPU of every agent start, a
    third of what the agent adds to Python's own start); the plain calls go straight to the C accelerator json
    itself uses (_json: the same scanner and encoder, so the same results), and everything else (indent,
    sort_keys, default, a document json refuses, an interpreter without _json) to the json module, imported
    then. What dumps cannot encode is refused here, in json's words."""

    def __init__(self):
        self.strict, self.object_hook, self.object_pairs_hook = True, None, None  # what _json's scanner reads
        self.parse_float, self.parse_int = float, int
        self.parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__
        try:
            import _json

            self._scan = _json.make_scanner(self)
            self._make_encoder, self._encode_str = _json.make_encoder, _json.encode_basestring_ascii
            self._fast = True
        except (ImportError, AttributeError, TypeError):
            self._fast = False

    @staticmethod
    def _module():
        import json

        return json

    def loads(self, s):
        if not self._fast or not isinstance(s, str):
            return self._module().loads(s)
        idx = len(s) - len(s.lstrip(" \t\n\r"))
        try:
            obj, end = self._scan(s, idx)
        except Exception:  # json says what is wrong (the scanner raises its own errors through json.decoder)
            return self._module().loads(s)
        if s[end:].strip(" \t\n\r"):
            return self._module().loads(s)  # extra data: json's error
        return obj

    def dumps(self, obj, **kw):
        if not self._fast or kw:
            return self._module().dumps(obj, **kw)
        if isinstance(obj, str):
            return self._encode_str(obj)

        def default(o):
            raise TypeError("Object of type %s is not JSON serializable" % o.__class__.__name__)

        # a new encoder (and dict of containers seen) per call, as json.dumps makes: an error mid-way leaves none
        encode = self._make_encoder({}, default, self._encode_str, None, ": ", ", ", False, False, True)
        return "".join(encode(obj, 0))

    def load(self, f):
        return self.loads(f.read())

    def dump(self, obj, f, **kw):
        f.write(self.dumps(obj, **kw))


json = _Json()
