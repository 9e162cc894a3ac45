#include "reshard/pickle.h"

#include <fmt/format.h>

#include <cstring>
#include <unordered_map>
#include <unordered_set>

namespace bragg::reshard {

namespace {

const std::unordered_set<std::string_view>& AllowList() {
  static const auto* const kSet = new std::unordered_set<std::string_view>{
      "torch._utils._rebuild_tensor",
      "torch._utils._rebuild_tensor_v2",
      "torch._utils._rebuild_parameter",
      "torch._utils._rebuild_parameter_with_state",
      "torch.FloatStorage",
      "torch.HalfStorage",
      "torch.BFloat16Storage",
      "torch.DoubleStorage",
      "torch.LongStorage",
      "torch.IntStorage",
      "torch.ShortStorage",
      "torch.CharStorage",
      "torch.ByteStorage",
      "torch.BoolStorage",
      "torch.UntypedStorage",
      "torch.float32",
      "torch.float",
      "torch.float16",
      "torch.half",
      "torch.bfloat16",
      "torch.float64",
      "torch.double",
      "torch.int64",
      "torch.long",
      "torch.int32",
      "torch.int",
      "torch.int16",
      "torch.int8",
      "torch.uint8",
      "torch.bool",
      "torch.strided",
      "torch.contiguous_format",
      "torch.preserve_format",
      "torch.channels_last",
      "torch.Size",
      "collections.OrderedDict",
      "argparse.Namespace",
      "_codecs.encode",
      "builtins.set",
      "builtins.frozenset",
      "torch.distributed.checkpoint.metadata.Metadata",
      "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
      "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
      "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
      "torch.distributed.checkpoint.metadata.TensorProperties",
      "torch.distributed.checkpoint.metadata.MetadataIndex",
      "torch.distributed._shard.checkpoint.metadata.Metadata",
      "torch.distributed._shard.checkpoint.metadata.TensorStorageMetadata",
      "torch.distributed._shard.checkpoint.metadata.BytesStorageMetadata",
      "torch.distributed._shard.checkpoint.metadata.ChunkStorageMetadata",
      "torch.distributed._shard.checkpoint.metadata.MetadataIndex",
      "torch.distributed._shard.metadata.ShardMetadata",
      "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
      "torch.distributed.checkpoint.filesystem._StorageInfo",
      "torch.distributed._shard.checkpoint.filesystem._StorageInfo",
  };
  return *kSet;
}

}  // namespace

bool IsAllowedGlobal(std::string_view qualified_name) {
  return AllowList().count(qualified_name) > 0;
}

bool PyValue::IsObjectOf(std::string_view name) const {
  return kind == Kind::kObject && callable != nullptr && callable->kind == Kind::kGlobal &&
         callable->allowed && callable->s == name;
}

const PyValue* PyValue::Get(std::string_view key) const {
  const std::vector<std::pair<const PyValue*, const PyValue*>>* d = nullptr;
  if (kind == Kind::kDict) {
    d = &dict;
  } else if (kind == Kind::kObject && state != nullptr && state->kind == Kind::kDict) {
    d = &state->dict;
  } else if (kind == Kind::kObject && state != nullptr && state->kind == Kind::kTuple &&
             state->items.size() == 2 && state->items[1]->kind == Kind::kDict) {
    // (dict_state, slots_state): dataclasses with __slots__.
    d = &state->items[1]->dict;
  }
  if (d == nullptr) {
    return nullptr;
  }
  for (const auto& [k, v] : *d) {
    if (k->kind == Kind::kStr && k->s == key) {
      return v;
    }
  }
  return nullptr;
}

class PickleParser {
 public:
  PickleParser(std::string_view data, const PickleLimits& limits) : d_(data), lim_(limits) {}

  Result<PickleDoc> Run() {
    if (d_.size() > lim_.max_input) {
      return absl::ResourceExhaustedError(
          fmt::format("pickle of {} bytes exceeds the limit of {}", d_.size(), lim_.max_input));
    }
    while (true) {
      if (pos_ >= d_.size()) {
        return Err("truncated pickle: no STOP opcode");
      }
      op_pos_ = pos_;
      uint8_t op = static_cast<uint8_t>(d_[pos_++]);
      BRAGG_ASSIGN_OR_RETURN(bool stop, Step(op));
      if (stop) {
        break;
      }
    }
    if (stack_.size() != 1 || !marks_.empty()) {
      return Err(fmt::format("STOP with {} values on the stack (want 1)", stack_.size()));
    }
    doc_.root_ = stack_.back();
    return std::move(doc_);
  }

 private:
  Status Err(std::string_view what) const {
    return absl::InvalidArgumentError(fmt::format("pickle byte {}: {}", op_pos_, what));
  }

  Result<PyValue*> New(PyValue::Kind kind) {
    if (doc_.arena_.size() >= lim_.max_values) {
      return absl::ResourceExhaustedError(
          fmt::format("pickle creates more than {} values", lim_.max_values));
    }
    PyValue& v = doc_.arena_.emplace_back();
    v.kind = kind;
    return &v;
  }

  Status Push(PyValue* v) {
    if (stack_.size() >= lim_.max_stack) {
      return absl::ResourceExhaustedError("pickle stack too deep");
    }
    stack_.push_back(v);
    return absl::OkStatus();
  }

  Result<PyValue*> Pop() {
    size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() <= floor) {
      return Err("stack underflow");
    }
    PyValue* v = stack_.back();
    stack_.pop_back();
    return v;
  }

  Result<PyValue*> Top() {
    size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() <= floor) {
      return Err("stack underflow");
    }
    return stack_.back();
  }

  // Pops everything above the last MARK and the mark itself.
  Result<std::vector<PyValue*>> PopMark() {
    if (marks_.empty()) {
      return Err("no MARK on the stack");
    }
    size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PyValue*> out(stack_.begin() + static_cast<ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return out;
  }

  Result<std::string_view> Take(uint64_t n) {
    if (n > d_.size() - pos_) {
      return Err(fmt::format("truncated: need {} bytes, {} left", n, d_.size() - pos_));
    }
    std::string_view out = d_.substr(pos_, n);
    pos_ += n;
    return out;
  }

  Result<uint64_t> TakeLe(int n) {
    BRAGG_ASSIGN_OR_RETURN(std::string_view b, Take(n));
    uint64_t v = 0;
    for (int k = n - 1; k >= 0; --k) {
      v = (v << 8) | static_cast<uint8_t>(b[k]);
    }
    return v;
  }

  Result<std::string_view> TakeLine() {
    size_t nl = d_.find('\n', pos_);
    if (nl == std::string_view::npos) {
      return Err("truncated: missing newline");
    }
    std::string_view out = d_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return out;
  }

  Status PushStr(PyValue::Kind kind, std::string_view s) {
    BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(kind));
    v->s = std::string(s);
    return Push(v);
  }

  Status PushInt(int64_t i) {
    BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(PyValue::Kind::kInt));
    v->i = i;
    return Push(v);
  }

  Status PushLong(std::string_view bytes) {
    if (bytes.size() > 8) {
      return Err(fmt::format("integer of {} bytes does not fit in 64 bits", bytes.size()));
    }
    uint64_t u = 0;
    for (size_t k = bytes.size(); k-- > 0;) {
      u = (u << 8) | static_cast<uint8_t>(bytes[k]);
    }
    if (!bytes.empty() && bytes.size() < 8 && (static_cast<uint8_t>(bytes.back()) & 0x80)) {
      u |= ~uint64_t{0} << (8 * bytes.size());
    }
    return PushInt(static_cast<int64_t>(u));
  }

  Status PushGlobal(std::string module, std::string name) {
    BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(PyValue::Kind::kGlobal));
    v->s = module + "." + name;
    v->allowed = IsAllowedGlobal(v->s);
    return Push(v);
  }

  Status PushTuple(std::vector<PyValue*> items) {
    BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(PyValue::Kind::kTuple));
    v->items.assign(items.begin(), items.end());
    return Push(v);
  }

  // REDUCE / NEWOBJ: records callable(args). A few allowed callables become plain values.
  Status PushCall(PyValue* callable, PyValue* args) {
    if (args->kind != PyValue::Kind::kTuple) {
      return Err("call arguments are not a tuple");
    }
    if (callable->kind == PyValue::Kind::kGlobal && callable->allowed) {
      if (callable->s == "collections.OrderedDict" && args->items.empty()) {
        BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(PyValue::Kind::kDict));
        return Push(v);
      }
      if (callable->s == "_codecs.encode" && args->items.size() == 2 &&
          args->items[0]->kind == PyValue::Kind::kStr) {
        // Protocol 2 pickles bytes as _codecs.encode(text, "latin1"); decode UTF-8 to latin1.
        const std::string& in = args->items[0]->s;
        std::string out;
        for (size_t k = 0; k < in.size(); ++k) {
          auto c = static_cast<uint8_t>(in[k]);
          if (c < 0x80) {
            out.push_back(static_cast<char>(c));
          } else if ((c & 0xE0) == 0xC0 && k + 1 < in.size()) {
            out.push_back(static_cast<char>(((c & 0x1F) << 6) | (in[k + 1] & 0x3F)));
            ++k;
          } else {
            return Err("_codecs.encode of a character outside latin1");
          }
        }
        return PushStr(PyValue::Kind::kBytes, out);
      }
      if ((callable->s == "builtins.set" || callable->s == "builtins.frozenset") &&
          args->items.size() <= 1) {
        BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(PyValue::Kind::kSet));
        if (args->items.size() == 1) {
          v->items = args->items[0]->items;
        }
        return Push(v);
      }
    }
    BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(PyValue::Kind::kObject));
    v->callable = callable;
    v->args = args;
    return Push(v);
  }

  Status AppendTo(PyValue* target, const std::vector<PyValue*>& items) {
    if (target->kind != PyValue::Kind::kList && target->kind != PyValue::Kind::kObject &&
        target->kind != PyValue::Kind::kSet) {
      return Err("APPEND(S)/ADDITEMS on a value that is not a list, set or object");
    }
    target->items.insert(target->items.end(), items.begin(), items.end());
    return absl::OkStatus();
  }

  Status SetItems(PyValue* target, const std::vector<PyValue*>& kv) {
    if (kv.size() % 2 != 0) {
      return Err("SETITEMS with an odd number of values");
    }
    if (target->kind != PyValue::Kind::kDict && target->kind != PyValue::Kind::kObject) {
      return Err("SETITEM(S) on a value that is not a dict or object");
    }
    for (size_t k = 0; k < kv.size(); k += 2) {
      target->dict.emplace_back(kv[k], kv[k + 1]);
    }
    return absl::OkStatus();
  }

  Status Memoize(uint64_t idx) {
    if (stack_.empty()) {
      return Err("memoize on an empty stack");
    }
    if (memo_.size() >= lim_.max_values) {
      return absl::ResourceExhaustedError("pickle memo too large");
    }
    memo_[idx] = stack_.back();
    return absl::OkStatus();
  }

  Status Get(uint64_t idx) {
    auto it = memo_.find(idx);
    if (it == memo_.end()) {
      return Err(fmt::format("memo key {} not found", idx));
    }
    return Push(it->second);
  }

  Result<bool> Step(uint8_t op) {
    using K = PyValue::Kind;
    switch (op) {
      case 0x80: {  // PROTO
        BRAGG_ASSIGN_OR_RETURN(uint64_t p, TakeLe(1));
        if (p < 2 || p > 5) {
          return Err(fmt::format("unsupported pickle protocol {}", p));
        }
        return false;
      }
      case 0x95:  // FRAME: the length only groups opcodes; frames are read as one stream.
        BRAGG_RETURN_IF_ERROR(TakeLe(8).status());
        return false;
      case '.':  // STOP
        return true;
      case '(':  // MARK
        if (marks_.size() >= lim_.max_marks) {
          return absl::ResourceExhaustedError("too many nested MARKs");
        }
        marks_.push_back(stack_.size());
        return false;
      case '0':  // POP
        BRAGG_RETURN_IF_ERROR(Pop().status());
        return false;
      case '1':  // POP_MARK
        BRAGG_RETURN_IF_ERROR(PopMark().status());
        return false;
      case '2': {  // DUP
        BRAGG_ASSIGN_OR_RETURN(PyValue * v, Top());
        BRAGG_RETURN_IF_ERROR(Push(v));
        return false;
      }
      case 'N': {
        // None, True and False are immutable (no op changes a kNone or kBool value): one value
        // each per document, so a run of them costs a stack slot each, not a value.
        if (none_ == nullptr) {
          BRAGG_ASSIGN_OR_RETURN(none_, New(K::kNone));
        }
        BRAGG_RETURN_IF_ERROR(Push(none_));
        return false;
      }
      case 0x88:
      case 0x89: {  // NEWTRUE, NEWFALSE
        PyValue*& v = op == 0x88 ? true_ : false_;
        if (v == nullptr) {
          BRAGG_ASSIGN_OR_RETURN(v, New(K::kBool));
          v->b = op == 0x88;
        }
        BRAGG_RETURN_IF_ERROR(Push(v));
        return false;
      }
      case 'I':
      case 'L': {  // INT, LONG (text)
        BRAGG_ASSIGN_OR_RETURN(std::string_view line, TakeLine());
        if (op == 'I' && (line == "00" || line == "01")) {
          BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(K::kBool));
          v->b = line == "01";
          BRAGG_RETURN_IF_ERROR(Push(v));
          return false;
        }
        if (!line.empty() && line.back() == 'L') {
          line.remove_suffix(1);
        }
        std::string text(line);
        char* end = nullptr;
        errno = 0;
        long long x = std::strtoll(text.c_str(), &end, 10);
        if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE) {
          return Err(fmt::format("bad integer literal '{}'", text.substr(0, 40)));
        }
        BRAGG_RETURN_IF_ERROR(PushInt(x));
        return false;
      }
      case 'J': {  // BININT
        BRAGG_ASSIGN_OR_RETURN(uint64_t u, TakeLe(4));
        BRAGG_RETURN_IF_ERROR(PushInt(static_cast<int32_t>(static_cast<uint32_t>(u))));
        return false;
      }
      case 'K': {  // BININT1
        BRAGG_ASSIGN_OR_RETURN(uint64_t u, TakeLe(1));
        BRAGG_RETURN_IF_ERROR(PushInt(static_cast<int64_t>(u)));
        return false;
      }
      case 'M': {  // BININT2
        BRAGG_ASSIGN_OR_RETURN(uint64_t u, TakeLe(2));
        BRAGG_RETURN_IF_ERROR(PushInt(static_cast<int64_t>(u)));
        return false;
      }
      case 0x8a: {  // LONG1
        BRAGG_ASSIGN_OR_RETURN(uint64_t n, TakeLe(1));
        BRAGG_ASSIGN_OR_RETURN(std::string_view b, Take(n));
        BRAGG_RETURN_IF_ERROR(PushLong(b));
        return false;
      }
      case 0x8b: {  // LONG4
        BRAGG_ASSIGN_OR_RETURN(uint64_t n, TakeLe(4));
        if (n & 0x80000000u) {
          return Err("negative LONG4 length");
        }
        BRAGG_ASSIGN_OR_RETURN(std::string_view b, Take(n));
        BRAGG_RETURN_IF_ERROR(PushLong(b));
        return false;
      }
      case 'G': {  // BINFLOAT, big-endian double
        BRAGG_ASSIGN_OR_RETURN(std::string_view b, Take(8));
        uint64_t u = 0;
        for (char c : b) {
          u = (u << 8) | static_cast<uint8_t>(c);
        }
        BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(K::kFloat));
        std::memcpy(&v->f, &u, 8);
        BRAGG_RETURN_IF_ERROR(Push(v));
        return false;
      }
      case 'F': {
        BRAGG_ASSIGN_OR_RETURN(std::string_view line, TakeLine());
        std::string text(line);
        char* end = nullptr;
        double x = std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size()) {
          return Err("bad float literal");
        }
        BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(K::kFloat));
        v->f = x;
        BRAGG_RETURN_IF_ERROR(Push(v));
        return false;
      }
      case 'S': {  // STRING: a repr; quotes stripped, escapes kept as written.
        BRAGG_ASSIGN_OR_RETURN(std::string_view line, TakeLine());
        if (line.size() < 2 || line.front() != line.back() ||
            (line.front() != '\'' && line.front() != '"')) {
          return Err("bad STRING literal");
        }
        BRAGG_RETURN_IF_ERROR(PushStr(K::kBytes, line.substr(1, line.size() - 2)));
        return false;
      }
      case 'V': {  // UNICODE (raw-unicode-escape; kept as written)
        BRAGG_ASSIGN_OR_RETURN(std::string_view line, TakeLine());
        BRAGG_RETURN_IF_ERROR(PushStr(K::kStr, line));
        return false;
      }
      case 'T':
      case 'X':
      case 'B': {  // BINSTRING, BINUNICODE, BINBYTES (4-byte length)
        BRAGG_ASSIGN_OR_RETURN(uint64_t n, TakeLe(4));
        BRAGG_ASSIGN_OR_RETURN(std::string_view b, Take(n));
        BRAGG_RETURN_IF_ERROR(PushStr(op == 'X' ? K::kStr : K::kBytes, b));
        return false;
      }
      case 'U':
      case 'C':
      case 0x8c: {  // SHORT_BINSTRING, SHORT_BINBYTES, SHORT_BINUNICODE
        BRAGG_ASSIGN_OR_RETURN(uint64_t n, TakeLe(1));
        BRAGG_ASSIGN_OR_RETURN(std::string_view b, Take(n));
        BRAGG_RETURN_IF_ERROR(PushStr(op == 0x8c ? K::kStr : K::kBytes, b));
        return false;
      }
      case 0x8d:
      case 0x8e:
      case 0x96: {  // BINUNICODE8, BINBYTES8, BYTEARRAY8
        BRAGG_ASSIGN_OR_RETURN(uint64_t n, TakeLe(8));
        BRAGG_ASSIGN_OR_RETURN(std::string_view b, Take(n));
        BRAGG_RETURN_IF_ERROR(PushStr(op == 0x8d ? K::kStr : K::kBytes, b));
        return false;
      }
      case ')':
        BRAGG_RETURN_IF_ERROR(PushTuple({}));
        return false;
      case 't': {
        BRAGG_ASSIGN_OR_RETURN(auto items, PopMark());
        BRAGG_RETURN_IF_ERROR(PushTuple(std::move(items)));
        return false;
      }
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        int n = op - 0x84;
        std::vector<PyValue*> items(n);
        for (int k = n - 1; k >= 0; --k) {
          BRAGG_ASSIGN_OR_RETURN(items[k], Pop());
        }
        BRAGG_RETURN_IF_ERROR(PushTuple(std::move(items)));
        return false;
      }
      case ']': {
        BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(K::kList));
        BRAGG_RETURN_IF_ERROR(Push(v));
        return false;
      }
      case 'l': {
        BRAGG_ASSIGN_OR_RETURN(auto items, PopMark());
        BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(K::kList));
        v->items.assign(items.begin(), items.end());
        BRAGG_RETURN_IF_ERROR(Push(v));
        return false;
      }
      case 'a': {
        BRAGG_ASSIGN_OR_RETURN(PyValue * item, Pop());
        BRAGG_ASSIGN_OR_RETURN(PyValue * list, Top());
        BRAGG_RETURN_IF_ERROR(AppendTo(list, {item}));
        return false;
      }
      case 'e':
      case 0x90: {  // APPENDS, ADDITEMS
        BRAGG_ASSIGN_OR_RETURN(auto items, PopMark());
        BRAGG_ASSIGN_OR_RETURN(PyValue * list, Top());
        BRAGG_RETURN_IF_ERROR(AppendTo(list, items));
        return false;
      }
      case '}': {
        BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(K::kDict));
        BRAGG_RETURN_IF_ERROR(Push(v));
        return false;
      }
      case 'd': {
        BRAGG_ASSIGN_OR_RETURN(auto items, PopMark());
        BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(K::kDict));
        BRAGG_RETURN_IF_ERROR(Push(v));
        BRAGG_RETURN_IF_ERROR(SetItems(v, items));
        return false;
      }
      case 's': {
        BRAGG_ASSIGN_OR_RETURN(PyValue * val, Pop());
        BRAGG_ASSIGN_OR_RETURN(PyValue * key, Pop());
        BRAGG_ASSIGN_OR_RETURN(PyValue * dict, Top());
        BRAGG_RETURN_IF_ERROR(SetItems(dict, {key, val}));
        return false;
      }
      case 'u': {
        BRAGG_ASSIGN_OR_RETURN(auto items, PopMark());
        BRAGG_ASSIGN_OR_RETURN(PyValue * dict, Top());
        BRAGG_RETURN_IF_ERROR(SetItems(dict, items));
        return false;
      }
      case 0x8f: {  // EMPTY_SET
        BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(K::kSet));
        BRAGG_RETURN_IF_ERROR(Push(v));
        return false;
      }
      case 0x91: {  // FROZENSET
        BRAGG_ASSIGN_OR_RETURN(auto items, PopMark());
        BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(K::kSet));
        v->items.assign(items.begin(), items.end());
        BRAGG_RETURN_IF_ERROR(Push(v));
        return false;
      }
      case 'c': {  // GLOBAL module\nname\n
        BRAGG_ASSIGN_OR_RETURN(std::string_view module, TakeLine());
        BRAGG_ASSIGN_OR_RETURN(std::string_view name, TakeLine());
        BRAGG_RETURN_IF_ERROR(PushGlobal(std::string(module), std::string(name)));
        return false;
      }
      case 0x93: {  // STACK_GLOBAL
        BRAGG_ASSIGN_OR_RETURN(PyValue * name, Pop());
        BRAGG_ASSIGN_OR_RETURN(PyValue * module, Pop());
        if (name->kind != K::kStr || module->kind != K::kStr) {
          return Err("STACK_GLOBAL needs two strings");
        }
        BRAGG_RETURN_IF_ERROR(PushGlobal(module->s, name->s));
        return false;
      }
      case 'R':
      case 0x81: {  // REDUCE, NEWOBJ
        BRAGG_ASSIGN_OR_RETURN(PyValue * args, Pop());
        BRAGG_ASSIGN_OR_RETURN(PyValue * callable, Pop());
        BRAGG_RETURN_IF_ERROR(PushCall(callable, args));
        return false;
      }
      case 0x92: {  // NEWOBJ_EX: cls, args, kwargs (kwargs ignored)
        BRAGG_RETURN_IF_ERROR(Pop().status());
        BRAGG_ASSIGN_OR_RETURN(PyValue * args, Pop());
        BRAGG_ASSIGN_OR_RETURN(PyValue * callable, Pop());
        BRAGG_RETURN_IF_ERROR(PushCall(callable, args));
        return false;
      }
      case 'b': {  // BUILD
        BRAGG_ASSIGN_OR_RETURN(PyValue * state, Pop());
        BRAGG_ASSIGN_OR_RETURN(PyValue * obj, Top());
        if (obj->kind == K::kObject) {
          obj->state = state;
        }
        return false;
      }
      case 'P': {  // PERSID (text id)
        BRAGG_ASSIGN_OR_RETURN(std::string_view line, TakeLine());
        BRAGG_ASSIGN_OR_RETURN(PyValue * id, New(K::kStr));
        id->s = std::string(line);
        BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(K::kPersistent));
        v->args = id;
        BRAGG_RETURN_IF_ERROR(Push(v));
        return false;
      }
      case 'Q': {  // BINPERSID
        BRAGG_ASSIGN_OR_RETURN(PyValue * id, Pop());
        BRAGG_ASSIGN_OR_RETURN(PyValue * v, New(K::kPersistent));
        v->args = id;
        BRAGG_RETURN_IF_ERROR(Push(v));
        return false;
      }
      case 'p': {
        BRAGG_ASSIGN_OR_RETURN(std::string_view line, TakeLine());
        std::string text(line);
        char* end = nullptr;
        unsigned long long idx = std::strtoull(text.c_str(), &end, 10);
        if (text.empty() || end != text.c_str() + text.size()) {
          return Err("bad PUT index");
        }
        BRAGG_RETURN_IF_ERROR(Memoize(idx));
        return false;
      }
      case 'q': {
        BRAGG_ASSIGN_OR_RETURN(uint64_t idx, TakeLe(1));
        BRAGG_RETURN_IF_ERROR(Memoize(idx));
        return false;
      }
      case 'r': {
        BRAGG_ASSIGN_OR_RETURN(uint64_t idx, TakeLe(4));
        BRAGG_RETURN_IF_ERROR(Memoize(idx));
        return false;
      }
      case 0x94:  // MEMOIZE
        BRAGG_RETURN_IF_ERROR(Memoize(memo_.size()));
        return false;
      case 'g': {
        BRAGG_ASSIGN_OR_RETURN(std::string_view line, TakeLine());
        std::string text(line);
        char* end = nullptr;
        unsigned long long idx = std::strtoull(text.c_str(), &end, 10);
        if (text.empty() || end != text.c_str() + text.size()) {
          return Err("bad GET index");
        }
        BRAGG_RETURN_IF_ERROR(Get(idx));
        return false;
      }
      case 'h': {
        BRAGG_ASSIGN_OR_RETURN(uint64_t idx, TakeLe(1));
        BRAGG_RETURN_IF_ERROR(Get(idx));
        return false;
      }
      case 'j': {
        BRAGG_ASSIGN_OR_RETURN(uint64_t idx, TakeLe(4));
        BRAGG_RETURN_IF_ERROR(Get(idx));
        return false;
      }
      default:
        return Err(
            fmt::format("unsupported opcode 0x{:02x} (INST, OBJ, EXT and out-of-band "
                        "buffers are refused)",
                        op));
    }
  }

  std::string_view d_;
  PickleLimits lim_;
  PyValue* none_ = nullptr;
  PyValue* true_ = nullptr;
  PyValue* false_ = nullptr;
  size_t pos_ = 0;
  size_t op_pos_ = 0;
  PickleDoc doc_;
  std::vector<PyValue*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PyValue*> memo_;
};

Result<PickleDoc> ParsePickle(std::string_view data, const PickleLimits& limits) {
  return PickleParser(data, limits).Run();
}

std::string DescribeValue(const PyValue* v, int max_depth) {
  if (v == nullptr) {
    return "<null>";
  }
  if (max_depth <= 0) {
    return "...";
  }
  using K = PyValue::Kind;
  auto list = [&](const std::vector<const PyValue*>& items, const char* open, const char* close) {
    std::string out = open;
    for (size_t k = 0; k < items.size(); ++k) {
      if (k > 0) {
        out += ", ";
      }
      if (k >= 8) {
        out += fmt::format("... {} more", items.size() - k);
        break;
      }
      out += DescribeValue(items[k], max_depth - 1);
    }
    return out + close;
  };
  switch (v->kind) {
    case K::kNone:
      return "None";
    case K::kBool:
      return v->b ? "True" : "False";
    case K::kInt:
      return std::to_string(v->i);
    case K::kFloat:
      return fmt::format("{}", v->f);
    case K::kStr:
      return fmt::format("'{}'", v->s.substr(0, 64));
    case K::kBytes:
      return fmt::format("<{} bytes>", v->s.size());
    case K::kTuple:
      return list(v->items, "(", ")");
    case K::kList:
      return list(v->items, "[", "]");
    case K::kSet:
      return list(v->items, "{", "}");
    case K::kDict:
      return fmt::format("{{dict of {}}}", v->dict.size());
    case K::kGlobal:
      return v->allowed ? v->s : fmt::format("<stub {}>", v->s);
    case K::kObject:
      return fmt::format("{}{}", DescribeValue(v->callable, max_depth - 1),
                         DescribeValue(v->args, max_depth - 1));
    case K::kPersistent:
      return fmt::format("persistent{}", DescribeValue(v->args, max_depth - 1));
  }
  return "?";
}

Result<int64_t> AsInt(const PyValue* v, std::string_view what) {
  if (v == nullptr || v->kind != PyValue::Kind::kInt) {
    return absl::InvalidArgumentError(
        fmt::format("{}: expected an int, got {}", what, DescribeValue(v, 2)));
  }
  return v->i;
}

Result<std::string> AsStr(const PyValue* v, std::string_view what) {
  if (v == nullptr || (v->kind != PyValue::Kind::kStr && v->kind != PyValue::Kind::kBytes)) {
    return absl::InvalidArgumentError(
        fmt::format("{}: expected a string, got {}", what, DescribeValue(v, 2)));
  }
  return v->s;
}

Result<std::vector<int64_t>> AsIntList(const PyValue* v, std::string_view what) {
  if (v != nullptr && v->IsObjectOf("torch.Size") && v->args != nullptr &&
      v->args->items.size() == 1) {
    v = v->args->items[0];
  }
  if (v == nullptr || (v->kind != PyValue::Kind::kTuple && v->kind != PyValue::Kind::kList)) {
    return absl::InvalidArgumentError(
        fmt::format("{}: expected a tuple of ints, got {}", what, DescribeValue(v, 2)));
  }
  std::vector<int64_t> out;
  out.reserve(v->items.size());
  for (const PyValue* item : v->items) {
    BRAGG_ASSIGN_OR_RETURN(int64_t x, AsInt(item, what));
    out.push_back(x);
  }
  return out;
}

}  // namespace bragg::reshard
