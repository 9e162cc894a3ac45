#include "gateway/radix_cache.h"

#include <algorithm>

namespace bragg::gateway {

struct RadixCache::Node {
  std::vector<int32_t> edge;
  std::vector<TokenTag> tags;
  std::unordered_map<int32_t, std::unique_ptr<Node>> children;
  Node* parent = nullptr;
  uint64_t last_access = 0;
};

namespace {

size_t CommonPrefix(std::span<const int32_t> a, const std::vector<int32_t>& b) {
  size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) {
    ++i;
  }
  return i;
}

}  // namespace

RadixCache::RadixCache(size_t capacity_tokens)
    : capacity_(capacity_tokens), root_(std::make_unique<Node>()) {}

RadixCache::~RadixCache() = default;

void RadixCache::Touch(Node* node) {
  uint64_t now = ++clock_;
  if (node != root_.get() && node->children.empty()) {
    leaves_.erase({node->last_access, node});
    node->last_access = now;
    leaves_.insert({now, node});
  } else {
    node->last_access = now;
  }
}

size_t RadixCache::Peek(std::span<const int32_t> tokens) const {
  const Node* node = root_.get();
  size_t pos = 0;
  while (pos < tokens.size()) {
    auto it = node->children.find(tokens[pos]);
    if (it == node->children.end()) {
      break;
    }
    const Node* child = it->second.get();
    size_t common = CommonPrefix(tokens.subspan(pos), child->edge);
    pos += common;
    if (common < child->edge.size()) {
      break;
    }
    node = child;
  }
  return pos;
}

size_t RadixCache::Match(std::span<const int32_t> tokens, std::vector<TokenTag>* tags) {
  if (tags != nullptr) {
    tags->clear();
  }
  Node* node = root_.get();
  size_t pos = 0;
  while (pos < tokens.size()) {
    auto it = node->children.find(tokens[pos]);
    if (it == node->children.end()) {
      break;
    }
    Node* child = it->second.get();
    size_t common = CommonPrefix(tokens.subspan(pos), child->edge);
    if (tags != nullptr) {
      tags->insert(tags->end(), child->tags.begin(), child->tags.begin() + common);
    }
    pos += common;
    Touch(child);
    if (common < child->edge.size()) {
      break;
    }
    node = child;
  }
  return pos;
}

void RadixCache::SplitAt(Node* node, size_t at) {
  Node* parent = node->parent;
  auto mid = std::make_unique<Node>();
  mid->edge.assign(node->edge.begin(), node->edge.begin() + at);
  mid->tags.assign(node->tags.begin(), node->tags.begin() + at);
  mid->parent = parent;
  mid->last_access = node->last_access;
  node->edge.erase(node->edge.begin(), node->edge.begin() + at);
  node->tags.erase(node->tags.begin(), node->tags.begin() + at);
  int32_t key = mid->edge.front();
  std::unique_ptr<Node> owned = std::move(parent->children[key]);
  node->parent = mid.get();
  mid->children[node->edge.front()] = std::move(owned);
  parent->children[key] = std::move(mid);
}

size_t RadixCache::Insert(std::span<const int32_t> tokens, std::span<const TokenTag> tags) {
  Node* node = root_.get();
  size_t pos = 0;
  size_t already = 0;
  while (pos < tokens.size()) {
    auto it = node->children.find(tokens[pos]);
    if (it == node->children.end()) {
      break;
    }
    Node* child = it->second.get();
    size_t common = CommonPrefix(tokens.subspan(pos), child->edge);
    if (common < child->edge.size()) {
      SplitAt(child, common);
      child = child->parent;
    }
    pos += common;
    Touch(child);
    node = child;
  }
  already = pos;
  if (pos < tokens.size()) {
    if (node != root_.get() && node->children.empty()) {
      leaves_.erase({node->last_access, node});
    }
    auto leaf = std::make_unique<Node>();
    leaf->edge.assign(tokens.begin() + pos, tokens.end());
    if (tags.empty()) {
      leaf->tags.assign(leaf->edge.size(), 0);
    } else {
      leaf->tags.assign(tags.begin() + pos, tags.begin() + tokens.size());
    }
    leaf->parent = node;
    leaf->last_access = ++clock_;
    size_ += leaf->edge.size();
    leaves_.insert({leaf->last_access, leaf.get()});
    node->children[leaf->edge.front()] = std::move(leaf);
  }
  if (capacity_ > 0) {
    EvictTo(capacity_);
  }
  return already;
}

void RadixCache::EvictTo(size_t limit) {
  while (size_ > limit && !leaves_.empty()) {
    auto [stamp, leaf] = *leaves_.begin();
    size_t need = size_ - limit;
    if (leaf->edge.size() > need) {
      leaf->edge.resize(leaf->edge.size() - need);
      leaf->tags.resize(leaf->edge.size());
      size_ -= need;
      return;
    }
    leaves_.erase(leaves_.begin());
    size_ -= leaf->edge.size();
    Node* parent = leaf->parent;
    parent->children.erase(leaf->edge.front());
    if (parent != root_.get() && parent->children.empty()) {
      leaves_.insert({parent->last_access, parent});
    }
  }
}

void RadixCache::Clear() {
  leaves_.clear();
  root_ = std::make_unique<Node>();
  size_ = 0;
}

}  // namespace bragg::gateway
