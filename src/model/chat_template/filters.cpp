// Jinja2's builtin filters on sequences and mappings (jinja2/filters.py); filters_text.cpp has
// those on strings and numbers. Filters that return a generator in Jinja2 (map, select, reject, selectattr, rejectattr, items, unique, batch,
// reverse of a list) return a List of type kIterator, so len() and indexing fail as they do there.
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "chat_template/interpreter.h"
#include "chat_template/pystr.h"
#include "fmt/format.h"

namespace cleave::jinja {
namespace {

Value generator(std::vector<Value> items, const char* type = "generator") {
  return Value::sequence(std::move(items), List::Type::kIterator, type);
}

Value lower_if_string(const Value& v) {
  return v.is_string() ? Value(py_lower(v.as_string())) : v;
}

// make_attrgetter: "a.b.0" looked up part by part with getitem (digit parts as ints).
struct AttrGetter {
  std::vector<Value> parts;
  Value fallback;  // map(default=...)
  bool ignore_case = false;

  Result<Value> operator()(Interpreter& in, Value item) const {
    for (const Value& p : parts) {
      CLEAVE_ASSIGN_OR_RETURN(item, in.getitem(item, p));
      if (!fallback.is_undefined() && !fallback.is_none() && item.is_undefined()) item = fallback;
    }
    return ignore_case ? lower_if_string(item) : item;
  }
};

AttrGetter make_getter(const Value& attribute, bool ignore_case, Value fallback = Value()) {
  AttrGetter g;
  g.ignore_case = ignore_case;
  g.fallback = std::move(fallback);
  if (attribute.is_string()) {
    for (const std::string& part : py_split(attribute.as_string(), std::string("."), -1)) {
      const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
      if (digits && part.size() < 18) {
        g.parts.emplace_back(static_cast<int64_t>(std::stoll(part)));
      } else {
        g.parts.emplace_back(part);
      }
    }
  } else if (!attribute.is_none()) {
    g.parts.push_back(attribute);
  }
  return g;
}

Result<std::vector<Value>> items_of(const Value& v) { return iterate(v); }

// --- sequences ------------------------------------------------------------------------------------

Result<Value> f_length(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "length"));
  CLEAVE_ASSIGN_OR_RETURN(int64_t n, length(v));
  return Value(n);
}
Result<Value> f_list(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "list"));
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, items_of(v));
  return Value::list(std::move(items));
}
Result<Value> f_first(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "first"));
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, items_of(v));
  if (items.empty()) return Value::undefined("No first item, sequence was empty.");
  return items.front();
}
Result<Value> f_last(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "last"));
  if (v.is_list() && v.as_list().type == List::Type::kIterator) {
    return TemplateError(fmt::format("'{}' object is not reversible", type_name(v)));
  }
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, items_of(v));
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return items.back();
}
Result<Value> f_reverse(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "reverse"));
  if (v.is_string()) {
    const std::string& s = v.as_string();
    return Value(py_slice(s, slice_indices(static_cast<int64_t>(utf8_length(s)), std::nullopt,
                                           std::nullopt, -1)));
  }
  if (!v.is_list() && !v.is_dict() && !v.is_undefined()) {
    return TemplateError("argument must be iterable");
  }
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, items_of(v));
  std::reverse(items.begin(), items.end());
  if (v.is_list() && v.as_list().type == List::Type::kIterator) return Value::list(std::move(items));
  const char* type = "reversed";
  if (v.is_list() && v.as_list().type == List::Type::kList) type = "list_reverseiterator";
  if (v.is_mapping()) type = "dict_reversekeyiterator";
  return generator(std::move(items), type);
}
Result<Value> f_join(Interpreter& in, const Value& v, CallArgs& a) {
  const Value sep = a.take(0, "d", Value(""));
  const Value attribute = a.take(1, "attribute", Value::none());
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 2, "join"));
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, items_of(v));
  const AttrGetter get = make_getter(attribute, false);
  const std::string d = to_str(sep);
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    CLEAVE_ASSIGN_OR_RETURN(Value item, get(in, items[i]));
    if (i > 0) out += d;
    out += item.is_string() ? item.as_string() : to_str(item);
    CLEAVE_RETURN_IF_ERROR(in.check_size(out.size()));
  }
  return Value(std::move(out));
}
Result<Value> f_default(Interpreter&, const Value& v, CallArgs& a) {
  const Value fallback = a.take(0, "default_value", Value(""));
  const bool boolean = truthy(a.take(1, "boolean", Value(false)));
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 2, "default"));
  if (v.is_undefined() || (boolean && !truthy(v))) return fallback;
  return v;
}
Result<Value> f_items(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "items"));
  if (v.is_undefined()) return generator({});
  if (!v.is_mapping()) return TemplateError("Can only get item pairs from a mapping.");
  std::vector<Value> out;
  for (const auto& [k, val] : v.as_dict().entries) out.push_back(Value::tuple({k, val}));
  return generator(std::move(out));
}
Result<Value> f_map(Interpreter& in, const Value& v, CallArgs& a) {
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, items_of(v));
  std::vector<Value> out;
  out.reserve(items.size());
  if (a.positional.empty() && a.has(SIZE_MAX, "attribute")) {
    const Value attribute = a.take(SIZE_MAX, "attribute");
    const Value fallback = a.take(SIZE_MAX, "default", Value::none());
    if (!a.keyword.empty()) {
      return TemplateError(fmt::format("Unexpected keyword argument '{}'", a.keyword.front().first));
    }
    const AttrGetter get = make_getter(attribute, false, fallback);
    for (const Value& item : items) {
      CLEAVE_ASSIGN_OR_RETURN(Value x, get(in, item));
      out.push_back(std::move(x));
    }
    return generator(std::move(out));
  }
  if (a.positional.empty()) return TemplateError("map requires a filter argument");
  const Value& name = a.positional[0];
  const FilterFn f = name.is_string() ? find_filter(name.as_string()) : nullptr;
  if (f == nullptr) return TemplateError(fmt::format("No filter named {}.", repr(name)));
  for (const Value& item : items) {
    CallArgs rest;
    rest.positional.assign(a.positional.begin() + 1, a.positional.end());
    rest.keyword = a.keyword;
    CLEAVE_RETURN_IF_ERROR(in.step());
    CLEAVE_ASSIGN_OR_RETURN(Value x, f(in, item, rest));
    out.push_back(std::move(x));
  }
  return generator(std::move(out));
}

// select / reject / selectattr / rejectattr.
Result<Value> select_impl(Interpreter& in, const Value& v, CallArgs& a, bool by_attr, bool keep) {
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, items_of(v));
  size_t off = 0;
  AttrGetter get;
  if (by_attr) {
    if (a.positional.empty()) return TemplateError("Missing parameter for attribute name");
    get = make_getter(a.positional[0], false);
    off = 1;
  }
  TestFn test = nullptr;
  if (a.positional.size() > off) {
    const Value& name = a.positional[off];
    test = name.is_string() ? find_test(name.as_string()) : nullptr;
    if (test == nullptr) return TemplateError(fmt::format("No test named {}.", repr(name)));
  }
  std::vector<Value> out;
  for (const Value& item : items) {
    CLEAVE_RETURN_IF_ERROR(in.step());
    CLEAVE_ASSIGN_OR_RETURN(Value x, get(in, item));
    bool r = false;
    if (test != nullptr) {
      CallArgs rest;
      rest.positional.assign(a.positional.begin() + static_cast<std::ptrdiff_t>(off + 1), a.positional.end());
      rest.keyword = a.keyword;
      CLEAVE_ASSIGN_OR_RETURN(r, test(in, x, rest));
    } else {
      r = truthy(x);
    }
    if (r == keep) out.push_back(item);
  }
  return generator(std::move(out));
}
Result<Value> f_select(Interpreter& in, const Value& v, CallArgs& a) { return select_impl(in, v, a, false, true); }
Result<Value> f_reject(Interpreter& in, const Value& v, CallArgs& a) { return select_impl(in, v, a, false, false); }
Result<Value> f_selectattr(Interpreter& in, const Value& v, CallArgs& a) { return select_impl(in, v, a, true, true); }
Result<Value> f_rejectattr(Interpreter& in, const Value& v, CallArgs& a) { return select_impl(in, v, a, true, false); }

// Sorts `items` by key (stable, like sorted()); comparison errors come back.
Status sort_by_keys(std::vector<Value>& items, std::vector<Value>& keys, bool reverse) {
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  Status error;
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    if (!error.ok()) return false;
    auto r = compare(reverse ? keys[y] : keys[x], reverse ? keys[x] : keys[y], "<");
    if (!r.ok()) {
      error = r.status();
      return false;
    }
    return *r;
  });
  CLEAVE_RETURN_IF_ERROR(error);
  std::vector<Value> sorted;
  sorted.reserve(items.size());
  for (size_t i : order) sorted.push_back(std::move(items[i]));
  items = std::move(sorted);
  return Status::Ok();
}

Result<Value> f_sort(Interpreter& in, const Value& v, CallArgs& a) {
  const bool reverse = truthy(a.take(0, "reverse", Value(false)));
  const bool case_sensitive = truthy(a.take(1, "case_sensitive", Value(false)));
  const Value attribute = a.take(2, "attribute", Value::none());
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 3, "sort"));
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, items_of(v));
  std::vector<AttrGetter> getters;
  if (attribute.is_string() && attribute.as_string().find(',') != std::string::npos) {
    for (const std::string& part : py_split(attribute.as_string(), std::string(","), -1)) {
      getters.push_back(make_getter(Value(part), !case_sensitive));
    }
  } else {
    getters.push_back(make_getter(attribute, !case_sensitive));
  }
  std::vector<Value> keys;
  keys.reserve(items.size());
  for (const Value& item : items) {
    if (getters.size() == 1) {
      CLEAVE_ASSIGN_OR_RETURN(Value k, getters[0](in, item));
      keys.push_back(std::move(k));
    } else {
      std::vector<Value> parts;
      for (const AttrGetter& g : getters) {
        CLEAVE_ASSIGN_OR_RETURN(Value k, g(in, item));
        parts.push_back(std::move(k));
      }
      keys.push_back(Value::list(std::move(parts)));
    }
  }
  CLEAVE_RETURN_IF_ERROR(sort_by_keys(items, keys, reverse));
  return Value::list(std::move(items));
}
Result<Value> f_dictsort(Interpreter&, const Value& v, CallArgs& a) {
  const bool case_sensitive = truthy(a.take(0, "case_sensitive", Value(false)));
  const Value by = a.take(1, "by", Value("key"));
  const bool reverse = truthy(a.take(2, "reverse", Value(false)));
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 3, "dictsort"));
  if (!by.is_string() || (by.as_string() != "key" && by.as_string() != "value")) {
    return TemplateError("You can only sort by either \"key\" or \"value\"");
  }
  if (!v.is_mapping()) return TemplateError(fmt::format("'{}' object has no attribute 'items'", type_name(v)));
  const bool by_key = by.as_string() == "key";
  std::vector<Value> items;
  std::vector<Value> keys;
  for (const auto& [k, val] : v.as_dict().entries) {
    items.push_back(Value::tuple({k, val}));
    const Value& key = by_key ? k : val;
    keys.push_back(case_sensitive ? key : lower_if_string(key));
  }
  CLEAVE_RETURN_IF_ERROR(sort_by_keys(items, keys, reverse));
  return Value::list(std::move(items));
}
Result<Value> f_unique(Interpreter& in, const Value& v, CallArgs& a) {
  const bool case_sensitive = truthy(a.take(0, "case_sensitive", Value(false)));
  const Value attribute = a.take(1, "attribute", Value::none());
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 2, "unique"));
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, items_of(v));
  const AttrGetter get = make_getter(attribute, !case_sensitive);
  Dict seen;
  std::vector<Value> out;
  for (const Value& item : items) {
    CLEAVE_ASSIGN_OR_RETURN(Value key, get(in, item));
    CLEAVE_RETURN_IF_ERROR(hash_key(key).status());
    if (seen.find(key) != nullptr) continue;
    CLEAVE_RETURN_IF_ERROR(seen.set(key, Value(true)));
    out.push_back(item);
  }
  return generator(std::move(out));
}
Result<Value> min_max(Interpreter& in, const Value& v, CallArgs& a, bool want_max) {
  const bool case_sensitive = truthy(a.take(0, "case_sensitive", Value(false)));
  const Value attribute = a.take(1, "attribute", Value::none());
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 2, want_max ? "max" : "min"));
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, items_of(v));
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  const AttrGetter get = make_getter(attribute, !case_sensitive);
  size_t best = 0;
  CLEAVE_ASSIGN_OR_RETURN(Value best_key, get(in, items[0]));
  for (size_t i = 1; i < items.size(); ++i) {
    CLEAVE_ASSIGN_OR_RETURN(Value key, get(in, items[i]));
    CLEAVE_ASSIGN_OR_RETURN(bool better, compare(key, best_key, want_max ? ">" : "<"));
    if (better) {
      best = i;
      best_key = std::move(key);
    }
  }
  return items[best];
}
Result<Value> f_min(Interpreter& in, const Value& v, CallArgs& a) { return min_max(in, v, a, false); }
Result<Value> f_max(Interpreter& in, const Value& v, CallArgs& a) { return min_max(in, v, a, true); }
Result<Value> f_sum(Interpreter& in, const Value& v, CallArgs& a) {
  const Value attribute = a.take(0, "attribute", Value::none());
  Value total = a.take(1, "start", Value(int64_t{0}));
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 2, "sum"));
  if (total.is_string()) return TemplateError("sum() can't sum strings [use ''.join(seq) instead]");
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, items_of(v));
  const AttrGetter get = make_getter(attribute, false);
  for (const Value& item : items) {
    CLEAVE_ASSIGN_OR_RETURN(Value x, get(in, item));
    CLEAVE_ASSIGN_OR_RETURN(total, binary_op(in, "+", total, x));
  }
  return total;
}
Result<Value> f_batch(Interpreter& in, const Value& v, CallArgs& a) {
  const Value count = a.take(0, "linecount");
  const Value fill = a.take(1, "fill_with", Value::none());
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 2, "batch"));
  if (!count.is_int() || count.as_int() <= 0) return TemplateError("batch() needs a positive linecount");
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, items_of(v));
  const auto n = static_cast<size_t>(count.as_int());
  std::vector<Value> out;
  for (size_t i = 0; i < items.size(); i += n) {
    std::vector<Value> row(items.begin() + static_cast<std::ptrdiff_t>(i),
                           items.begin() + static_cast<std::ptrdiff_t>(std::min(items.size(), i + n)));
    if (row.size() < n && !fill.is_none()) {
      CLEAVE_RETURN_IF_ERROR(in.check_size(n));
      row.resize(n, fill);
    }
    out.push_back(Value::list(std::move(row)));
  }
  return generator(std::move(out));
}
Result<Value> f_attr(Interpreter& in, const Value& v, CallArgs& a) {
  const Value name = a.take(0, "name");
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 1, "attr"));
  if (!name.is_string()) return TemplateError("attribute name must be a string");
  return in.getattr(v, name.as_string());
}

struct FilterEntry {
  const char* name;
  FilterFn fn;
};

const FilterEntry kFilters[] = {
    {"attr", f_attr}, {"batch", f_batch}, {"count", f_length},
    {"d", f_default}, {"default", f_default}, {"dictsort", f_dictsort},
    {"first", f_first}, {"items", f_items}, {"join", f_join},
    {"last", f_last}, {"length", f_length}, {"list", f_list},
    {"map", f_map}, {"max", f_max}, {"min", f_min},
    {"reject", f_reject}, {"rejectattr", f_rejectattr}, {"reverse", f_reverse},
    {"select", f_select}, {"selectattr", f_selectattr}, {"sort", f_sort},
    {"sum", f_sum}, {"unique", f_unique},
};

}  // namespace

FilterFn find_filter(std::string_view name) {
  for (const FilterEntry& e : kFilters) {
    if (name == e.name) return e.fn;
  }
  return find_scalar_filter(name);
}

}  // namespace cleave::jinja
