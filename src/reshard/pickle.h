#pragma once

// A restricted reader for Python pickles (protocols 2-5) that executes nothing.
//
// The reader builds a value tree from the opcode stream. GLOBAL/STACK_GLOBAL never import
// anything: a name on the allow-list (torch rebuild functions, storage types, dtypes, layouts,
// memory formats, the distributed-checkpoint metadata classes, OrderedDict, argparse.Namespace)
// becomes a Global value marked `allowed`; anything else becomes a Global marked as a stub.
// REDUCE, NEWOBJ and BUILD only record the callable, its arguments and the state. Consumers decide
// what an allowed object means; a stub is opaque data.

#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace bragg::reshard {

struct PickleLimits {
  // Largest pickle accepted, in bytes.
  uint64_t max_input = 1ull << 30;
  // Most values that may be created (bounds memory: each opcode creates at most one value).
  uint64_t max_values = 50'000'000;
  // Deepest MARK nesting and deepest stack.
  uint32_t max_marks = 10'000;
  uint64_t max_stack = 50'000'000;
};

// One value of the pickled object graph. Values live in a PickleDoc's arena and refer to each
// other with raw pointers that stay valid as long as the PickleDoc lives; the graph may share
// nodes and, for hostile input, contain cycles (walkers must bound their depth).
struct PyValue {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kStr,
    kBytes,
    kTuple,
    kList,
    kDict,
    kSet,
    kGlobal,      // module.name; `allowed` says whether it is on the allow-list
    kObject,      // callable(args) from REDUCE/NEWOBJ, with state from BUILD
    kPersistent,  // persistent id (torch storages)
  };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                      // kStr, kBytes; for kGlobal "module.name"
  bool allowed = false;               // kGlobal
  std::vector<const PyValue*> items;  // kTuple, kList, kSet
  std::vector<std::pair<const PyValue*, const PyValue*>> dict;  // kDict; kObject dict items
  const PyValue* callable = nullptr;  // kObject: a kGlobal (or another value for stubs)
  const PyValue* args = nullptr;      // kObject: the argument tuple; kPersistent: the id
  const PyValue* state = nullptr;     // kObject: BUILD state, nullptr when none

  bool IsNone() const { return kind == Kind::kNone; }
  // For kObject: true when the callable is an allowed global named `name`.
  bool IsObjectOf(std::string_view name) const;
  // Dict lookup by string key (kDict, or a kObject's dict-shaped state). nullptr when missing.
  const PyValue* Get(std::string_view key) const;
};

// Owns every value of one parsed pickle. Move-only; not thread-safe for mutation, but a parsed
// document is immutable and may be read from many threads.
class PickleDoc {
 public:
  PickleDoc() = default;
  PickleDoc(PickleDoc&&) = default;
  PickleDoc& operator=(PickleDoc&&) = default;
  PickleDoc(const PickleDoc&) = delete;
  PickleDoc& operator=(const PickleDoc&) = delete;

  // The value STOP returned.
  const PyValue* root() const { return root_; }

 private:
  friend class PickleParser;
  std::deque<PyValue> arena_;
  const PyValue* root_ = nullptr;
};

// Parses `data`. InvalidArgument for malformed input (truncated, unknown or unsupported opcode,
// stack underflow, bad memo reference, a pickle that leaves more than one value), with the
// offending byte offset; ResourceExhausted past `limits`. Never executes or imports anything.
[[nodiscard]] Result<PickleDoc> ParsePickle(std::string_view data, const PickleLimits& limits = {});

// True when "module.name" is on the allow-list.
bool IsAllowedGlobal(std::string_view qualified_name);

// Short, depth-bounded text form for error messages and `inspect` ("torch.Size((2, 3))").
std::string DescribeValue(const PyValue* v, int max_depth = 4);

// Convenience accessors: InvalidArgument naming `what` when `v` has the wrong kind.
[[nodiscard]] Result<int64_t> AsInt(const PyValue* v, std::string_view what);
[[nodiscard]] Result<std::string> AsStr(const PyValue* v, std::string_view what);
// A tuple/list of ints, or a torch.Size(...) object wrapping one.
[[nodiscard]] Result<std::vector<int64_t>> AsIntList(const PyValue* v, std::string_view what);

}  // namespace bragg::reshard
