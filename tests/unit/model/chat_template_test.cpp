// Chat-template interpreter: the Jinja2 language features real templates use (expected values
// rendered by Jinja2 3.1 in transformers' environment), errors with Python's messages, limits that
// keep a hostile template from crashing or hanging the process, the fallback template, and the
// shared conformance suite (../shared/chat-templates: every case must match exactly).
#include "cleave/model/chat_template.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace cleave {
namespace {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;

struct RenderCase {
  const char* name;
  const char* tmpl;
  const char* context;  // JSON object
  const char* expected;  // rendered text, or the error message for kErrorCases
};

// Generated from Jinja2 3.1 (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
// loopcontrols, transformers' tojson, strftime_now fixed at 2024-07-26 12:00).
const RenderCase kRenderCases[] = {
    {"WhitespaceTrimAndLstrip", "{% if true %}\n"
         "  a\n"
         "  {% if true %}\n"
         "    b\n"
         "  {% endif %}\n"
         "{% endif %}\n"
         "  c {# comment #}\n"
         "  {# c2 #}\n"
         "d",
     "{}",
     "  a\n"
         "    b\n"
         "  c d"},
    {"WhitespaceDashControl", "a  \n"
         "  {%- if true %}x{% endif %}|{% if 1 -%}  \n"
         "\n"
         "  b{%- endif %}|{{- ' c ' -}}  |",
     "{}",
     "ax|b| c |"},
    {"WhitespacePlusKeepsIndentation", "  {% if true %}\n"
         "x\n"
         "  {%+ endif %}\n"
         "y",
     "{}",
     "x\n"
         "  y"},
    {"TrailingNewlineDropped", "line1\r\n"
         "line2\n",
     "{}",
     "line1\n"
         "line2"},
    {"RawBlock", "{% raw %}\n"
         "  {{ x }}\n"
         "  {% endraw %}\n"
         "z",
     "{}",
     "\n"
         "  {{ x }}\n"
         "z"},
    {"UndefinedRendersEmpty", "[{{ missing }}][{{ missing is defined }}][{{ x.y is defined }}][{{ none }}]",
     "{\"x\": {}}",
     "[][False][False][None]"},
    {"PythonRepr", "{{ [1, 'a', none, true, 1.0, {'x': \"it's\"}, (1,), ('a', 'b')] }}",
     "{}",
     "[1, 'a', None, True, 1.0, {'x': \"it's\"}, (1,), ('a', 'b')]"},
    {"FloatFormatting", "{{ 1e16 }} {{ 1.5e-5 }} {{ 0.1 + 0.2 }} {{ 1/3 }} {{ 100.0 }} {{ -0.0 }} {{ 1e15 }}",
     "{}",
     "1e+16 1.5e-05 0.30000000000000004 0.3333333333333333 100.0 -0.0 1000000000000000.0"},
    {"IntegerArithmetic", "{{ 10 / 4 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 7.5 // 2 }} {{ true + true }}",
     "{}",
     "2.5 3 -4 2 -2 1024 0.5 3.0 2"},
    {"StringOperators", "{{ 'ab' * 3 }}{{ 1 ~ 2 ~ none ~ missing }}{{ [1] + [2] }}{{ 'a' ~ 1.0 }}",
     "{}",
     "ababab12None[1, 2]a1.0"},
    {"Comparisons", "{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}{{ 1 == 1.0 }}{{ 'a' != 'b' }}{{ 1 in [1] }}{{ 1 not in [2] }}{{ 'b' in 'abc' }}{{ 'k' in {'k': 1} }}{{ 'x' in missing }}",
     "{}",
     "TrueFalseTrueTrueTrueTrueTrueTrueFalse"},
    {"AndOrReturnOperands", "{{ true and 'x' }}|{{ false or 'y' }}|{{ none or [] }}|{{ 0 and 1 }}|{{ not '' }}",
     "{}",
     "x|y|[]|0|True"},
    {"Ternary", "{{ 'a' if x else 'b' }}{{ 'c' if not x }}|{{ 1 if x is defined else 2 }}",
     "{\"x\": 0}",
     "bc|1"},
    {"Slicing", "{{ 'abc'[::-1] }} {{ 'Grüße'[1:3] }} {{ 'Grüße'|length }} {{ 'Grüße'[-1] }} {{ [1,2,3,4][1:] }} {{ [1,2,3,4][::2] }} {{ [1,2,3][5:] }} {{ messages[-1:] }}",
     "{\"messages\": [1, 2]}",
     "cba rü 5 e [2, 3, 4] [1, 3] [] [2]"},
    {"Indexing", "{{ [1,2,3][-1] }}|{{ [1,2,3][10] }}|{{ 'abc'[1] }}|{{ d.a }}{{ d['a'] }}{{ d['items'] }}{{ d.items is callable }}",
     "{\"d\": {\"a\": 1, \"items\": \"shadowed\"}}",
     "3||b|11shadowedTrue"},
    {"LoopVariables", "{% for x in ['a','b','c'] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('x','y') }};{% endfor %}",
     "{}",
     "103TrueFalse3bx;212FalseFalse3acy;321FalseTrue3bx;"},
    {"LoopElseFilterBreakContinue", "{% for x in [] %}a{% else %}empty{% endfor %} {% for x in range(10) if x is odd %}{% if x == 3 %}{% continue %}{% endif %}{% if x > 6 %}{% break %}{% endif %}{{ x }}/{{ loop.length }} {% endfor %}",
     "{}",
     "empty 1/5 5/5 "},
    {"LoopScoping", "{% set c = 0 %}{% for i in [1,2,3] %}{% set c = c + 1 %}{{ c }}{% endfor %}{{ c }}[{{ i }}]",
     "{}",
     "1110[]"},
    {"RecursiveLoop", "{% for item in tree recursive %}{{ item.n }}{% if item.c %}({{ loop(item.c) }}){% endif %}{% endfor %}",
     "{\"tree\": [{\"n\": 1, \"c\": [{\"n\": 2, \"c\": [{\"n\": 3}]}]}, {\"n\": 4}]}",
     "1(2(3))4"},
    {"UnpackingItems", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k, v in d|items %}{{ k }}{% endfor %}{% for k, v in d|dictsort %}{{ k }}{% endfor %}",
     "{\"d\": {\"b\": 1, \"a\": 2}}",
     "b=1;a=2;baab"},
    {"NamespaceAssignment", "{% set ns = namespace(found=false, n=0) %}{% for x in [1,2,3] %}{% if x == 2 %}{% set ns.found = true %}{% endif %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.found }}{{ ns.n }}{{ ns }}",
     "{}",
     "True6<Namespace {'found': True, 'n': 6}>"},
    {"SetForms", "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = 1, 2 %}{{ t }}{% set x %}inner {{ 1 + 1 }}{% endset %}[{{ x }}]{% set y | upper %}yy{% endset %}{{ y }}",
     "{}",
     "12(1, 2)[inner 2]YY"},
    {"Macros", "{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ greet('Bob') }} {{ greet('Al', greeting='Hi') }} {{ greet() }}{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, x=3) }}",
     "{}",
     "Hello, Bob! Hi, Al! Hello, !1(2,){'x': 3}"},
    {"CallBlocks", "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}bold{% endcall %}{% macro each(xs) %}{% for i in xs %}{{ caller(i) }};{% endfor %}{% endmacro %}{% call(x) each([1,2]) %}[{{ x }}]{% endcall %}",
     "{}",
     "<b>bold</b>[1];[2];"},
    {"FilterAndWithBlocks", "{% filter upper %}abc {{ 'd' }}{% endfilter %}|{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}[{{ a }}]",
     "{}",
     "ABC D|3[]"},
    {"StringMethods", "{{ 'Hello World'.lower() }}{{ 'a,b,c'.split(',') }}{{ ' a b  c '.split() }}{{ 'a b c'.rsplit(' ', 1) }}{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}{{ '  x '.strip() }}|{{ 'xyx'.strip('x') }}{{ '\\n\\nx\\n'.lstrip('\\n') }}{{ 'hello world'.title() }}{{ 'a-b'.replace('-', '+') }}{{ 'hello'.find('l') }}{{ '-'.join(['a','b']) }}{{ 'x'.center(5, '*') }}",
     "{}",
     "hello world['a', 'b', 'c']['a', 'b', 'c']['a b', 'c']TrueTruex|yx\n"
         "Hello Worlda+b2a-b**x**"},
    {"DictMethods", "{{ d.keys()|list }}{{ d.values()|list }}{{ d.get('a') }}{{ d.get('z') }}{{ d.get('z', 5) }}{{ d.items() }}{{ d|length }}",
     "{\"d\": {\"b\": 1, \"a\": 2}}",
     "['b', 'a'][1, 2]2None5dict_items([('b', 1), ('a', 2)])2"},
    {"StringFilters", "{{ '  a  '|trim }}{{ 'xxaxx'|trim('x') }}{{ 'hello world-foo'|title }}{{ 'abc'|upper }}{{ 'ABC'|lower }}{{ 'abc'|capitalize }}{{ 'a b'|replace(' ', '_') }}{{ 5|replace('5', '6') }}{{ '<&>'|e }}{{ 'abc'|reverse }}{{ 'x'|center(5) }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'hello world foo bar'|truncate(9) }}{{ 'one two'|wordcount }}",
     "{}",
     "aaHello World-FooABCabcAbca_b6&lt;&amp;&gt;cba  x  |  a\n"
         "  b|hello...2"},
    {"SequenceFilters", "{{ [3,1,2]|sort }}{{ ['b','A','a']|sort }}{{ [{'a':2},{'a':1}]|sort(attribute='a', reverse=true) }}{{ [1,2,3]|sum }}{{ [1,2]|max }}{{ ['b','A']|min }}{{ ['a','A','b']|unique|list }}{{ [1,2,3,4,5]|batch(2)|list }}{{ [1,2]|first }}{{ [1,2]|last }}{{ 'ab'|list }}{{ [1,2,3]|join('-') }}{{ []|first is defined }}",
     "{}",
     "[1, 2, 3]['A', 'a', 'b'][{'a': 2}, {'a': 1}]62A['a', 'b'][[1, 2], [3, 4], [5]]12['a', 'b']1-2-3False"},
    {"MapSelectFilters", "{{ [1,2]|map('string')|join(',') }}|{{ ms|map(attribute='role')|list }}|{{ ms|selectattr('role', 'equalto', 'user')|list|length }}|{{ ms|rejectattr('role', '==', 'user')|map(attribute='role')|first }}|{{ [1,2,3]|select('odd')|list }}{{ [1,2,3]|reject('odd')|list }}|{{ ms|map(attribute='x', default='-')|join }}",
     "{\"ms\": [{\"role\": \"user\"}, {\"role\": \"assistant\"}, {\"role\": \"user\"}]}",
     "1,2|['user', 'assistant', 'user']|2|assistant|[1, 3][2]|---"},
    {"NumberFilters", "{{ 3.7|int }}{{ '42.5'|int }}{{ 'x'|int }}{{ ' 12 '|int }}{{ '0x1A'|int(base=16) }} {{ 2.5|round }} {{ 3|round }} {{ 2.675|round(2) }} {{ 2.1|round(0, 'ceil') }} {{ '3.5'|float }} {{ -5|abs }}",
     "{}",
     "34201226 2.0 3 2.67 3.0 3.5 5"},
    {"DefaultAndLength", "{{ 'a'|default('b') }}{{ x|default('b') }}{{ ''|default('b', true) }}{{ none|default('b') }}{{ x|length }}{{ 'Grüße'|count }}{{ {'a': 1}|length }}",
     "{}",
     "abbNone051"},
    {"ToJson", "{{ d|tojson }}|{{ d|tojson(indent=2) }}|{{ [] | tojson(indent=2) }}|{{ d|tojson(separators=(',', ':'), sort_keys=true) }}|{{ 'é\"\\n\\u0001'|tojson }}|{{ '😀'|tojson(ensure_ascii=true) }}|{{ [0.1, 1e20, 3.0]|tojson }}",
     "{\"d\": {\"z\": [1, {\"b\": \"é\"}], \"a\": null, \"f\": 1.5, \"t\": true}}",
     "{\"z\": [1, {\"b\": \"é\"}], \"a\": null, \"f\": 1.5, \"t\": true}|{\n"
         "  \"z\": [\n"
         "    1,\n"
         "    {\n"
         "      \"b\": \"é\"\n"
         "    }\n"
         "  ],\n"
         "  \"a\": null,\n"
         "  \"f\": 1.5,\n"
         "  \"t\": true\n"
         "}|[]|{\"a\":null,\"f\":1.5,\"t\":true,\"z\":[1,{\"b\":\"é\"}]}|\"é\\\"\\n\\u0001\"|\"\\ud83d\\ude00\"|[0.1, 1e+20, 3.0]"},
    {"Tests", "{{ x is number }}{{ true is number }}{{ true is integer }}{{ 1.0 is float }}{{ 's' is string }}{{ {} is mapping }}{{ 's' is iterable }}{{ missing is iterable }}{{ 5 is iterable }}{{ {} is sequence }}{{ none is none }}{{ 1 is not none }}{{ 4 is divisibleby 2 }}{{ 3 is odd }}{{ 2 is even }}{{ 'a' is lower }}{{ 'A' is upper }}{{ 1 is eq 1 }}{{ 2 is gt 1 }}{{ 1 is in [1] }}{{ true is true }}{{ 0 is false }}{{ range is callable }}{{ 'upper' is filter }}{{ 'odd' is test }}",
     "{\"x\": 1}",
     "TrueTrueFalseTrueTrueTrueTrueTrueFalseTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueFalseTrueTrueTrue"},
    {"PercentFormat", "{{ '%s-%d-%r-%05.2f-%x-%%' % ('a', 3, 'b', 3.14159, 255) }}|{{ '%s=%s'|format('a', 1) }}|{{ '%(a)s' % {'a': 1} }}|{{ 'xxx' % [1] }}|{{ '%s' % [1, 2] }}",
     "{}",
     "a-3-'b'-03.14-ff-%|a=1|1|xxx|[1, 2]"},
    {"ReplaceStringifiesArguments", "{{ 5|replace(5, x) }}|{{ 'a1'|replace(1, 2) }}",
     "{}",
     "|a2"},
    {"Globals", "{{ range(3)|list }}{{ range(1, 10, 3)|list }}{{ range(5, 0, -2)|list }}{{ dict(a=1) }}{% set j = joiner(' | ') %}{% for x in [1,2,3] %}{{ j() }}{{ x }}{% endfor %}{{ strftime_now('%Y-%m-%d %H:%M %A %B %d') }}",
     "{}",
     "[0, 1, 2][1, 4, 7][5, 3, 1]{'a': 1}1 | 2 | 32024-07-26 12:00 Friday July 26"},
    {"UnicodeCase", "{{ 'ÀÉÎ'|lower }}{{ 'straße'|upper }}{{ 'ß'.title() }}{{ 'grüße'.capitalize() }}",
     "{}",
     "àéîSTRASSESsGrüße"},
};

const RenderCase kErrorCases[] = {
    {"UndefinedAttributeOfUndefined", "{{ x.y }}",
     "{}",
     "'x' is undefined"},
    {"IndexOfEmptyList", "{{ messages[0]['role'] }}",
     "{\"messages\": []}",
     "list object has no element 0"},
    {"MissingKeyThenAttribute", "{{ m.content.strip() }}",
     "{\"m\": {}}",
     "'dict object' has no attribute 'content'"},
    {"ConcatNone", "{{ 'a' + none }}",
     "{}",
     "can only concatenate str (not \"NoneType\") to str"},
    {"ConcatInt", "{{ 'a' + 1 }}",
     "{}",
     "can only concatenate str (not \"int\") to str"},
    {"IntPlusStr", "{{ 1 + 'a' }}",
     "{}",
     "unsupported operand type(s) for +: 'int' and 'str'"},
    {"DivisionByZero", "{{ 3 / 0 }}",
     "{}",
     "division by zero"},
    {"FloorDivisionByZero", "{{ 3 // 0 }}",
     "{}",
     "integer division or modulo by zero"},
    {"ModuloByZero", "{{ 3 % 0 }}",
     "{}",
     "integer modulo by zero"},
    {"Unorderable", "{{ 'x' < 1 }}",
     "{}",
     "'<' not supported between instances of 'str' and 'int'"},
    {"CallUndefined", "{{ foo() }}",
     "{}",
     "'foo' is undefined"},
    {"CallString", "{{ 'a'() }}",
     "{}",
     "'str' object is not callable"},
    {"SandboxBlocksListAppend", "{{ [].append(1) }}",
     "{}",
     "access to attribute 'append' of 'list' object is unsafe."},
    {"SandboxBlocksDictUpdate", "{{ {}.update({}) }}",
     "{}",
     "access to attribute 'update' of 'dict' object is unsafe."},
    {"TojsonUndefined", "{{ x | tojson }}",
     "{}",
     "Object of type Undefined is not JSON serializable"},
    {"InNone", "{{ 1 in none }}",
     "{}",
     "argument of type 'NoneType' is not iterable"},
    {"LengthOfNone", "{{ none|length }}",
     "{}",
     "object of type 'NoneType' has no len()"},
    {"LengthOfGenerator", "{{ [1]|select|length }}",
     "{}",
     "object of type 'generator' has no len()"},
    {"UnpackTooFew", "{% for a, b in [[1,2],[3]] %}{{ a }}{% endfor %}",
     "{}",
     "not enough values to unpack (expected 2, got 1)"},
    {"IterateInt", "{% for x in 5 %}{% endfor %}",
     "{}",
     "'int' object is not iterable"},
    {"SetAttributeOnNonNamespace", "{% set x.y = 1 %}",
     "{}",
     "cannot assign attribute on non-namespace object"},
    {"MacroTooManyArgs", "{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}",
     "{}",
     "macro 'm' takes not more than 1 argument(s)"},
    {"RaiseException", "a{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}",
     "{}",
     "Conversation roles must alternate user/assistant/user/assistant/..."},
    {"RangeTooBig", "{{ range(1000000)|length }}",
     "{}",
     "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000)."},
    {"UnknownFilterInMap", "{{ [1]|map('nope')|list }}",
     "{}",
     "No filter named 'nope'."},
    {"EmptySeparator", "{{ 'a'.split('') }}",
     "{}",
     "empty separator"},
    {"SetAttributeChecksTargetFirst", "{% set x.y = missing.z %}",
     "{}",
     "cannot assign attribute on non-namespace object"},
    {"CallerGivenToMacroWithoutCaller", "{% macro m() %}x{% endmacro %}{% call m() %}body{% endcall %}",
     "{}",
     "macro 'm' was invoked with two values for the special caller argument. This is most likely a bug."},
    {"SliceStepZero", "{{ [1, 2][::z] }}",
     "{\"z\": 0}",
     "slice step cannot be zero"},
    {"SliceOfDict", "{{ d[1:] }}",
     "{\"d\": {\"a\": 1}}",
     "unhashable type: 'slice'"},
    {"StripArgType", "{{ 'a'.strip(1) }}",
     "{}",
     "strip arg must be None or str"},
    {"TojsonSortKeysMixed", "{{ {none: 1, 'a': 2}|tojson(sort_keys=true) }}",
     "{}",
     "'<' not supported between instances of 'str' and 'NoneType'"},
};

std::tm fixed_now() {
  auto t = parse_chat_template_time("2024-07-26T12:00:00");
  EXPECT_TRUE(t.ok());
  return *t;
}

Result<std::string> render(std::string_view tmpl, const ordered_json& context = ordered_json::object(),
                           const ChatTemplateLimits& limits = {}) {
  CLEAVE_ASSIGN_OR_RETURN(ChatTemplate t, ChatTemplate::parse(tmpl, limits));
  return t.render(context, fixed_now());
}

TEST(ChatTemplateLanguage, RendersLikeJinja2) {
  for (const RenderCase& c : kRenderCases) {
    SCOPED_TRACE(c.name);
    auto r = render(c.tmpl, ordered_json::parse(c.context));
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(*r, c.expected);
  }
}

TEST(ChatTemplateLanguage, ErrorsCarryPythonsMessages) {
  for (const RenderCase& c : kErrorCases) {
    SCOPED_TRACE(c.name);
    auto r = render(c.tmpl, ordered_json::parse(c.context));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), c.expected);
  }
}

TEST(ChatTemplateLanguage, GenerationBlockRendersInPlace) {
  auto r = render("a{% generation %}b{{ 1 }}{% endgeneration %}c");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, "ab1c");
}

TEST(ChatTemplateLanguage, SyntaxErrorsAreInvalidArgumentWithALine) {
  const char* bad[] = {
      "{% if x %}never closed",
      "{% for x in y %}{% endif %}",
      "{% frobnicate %}",
      "{{ x | no_such_filter }}",
      "{{ x is no_such_test }}",
      "{{ 'unterminated }}",
      "{{ x $ y }}",
      "{{ }}",
      "{{ (1, 2 }}",
      "{% break %}",
      "{% do x.append(1) %}",  // the do extension is not loaded, as in transformers
      "{% macro m(a=1, b) %}{% endmacro %}",
      "\n\n{{ 1 +  }}",
  };
  for (const char* t : bad) {
    SCOPED_TRACE(t);
    auto r = ChatTemplate::parse(t);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("line"), std::string::npos) << r.status().message();
  }
  auto r = ChatTemplate::parse("\n\n{{ 1 +  }}");
  EXPECT_NE(r.status().message().find("line 3"), std::string::npos) << r.status().message();
}

TEST(ChatTemplateLanguage, DictsKeepTheOrderOfOrderedJson) {
  const ordered_json ctx = ordered_json::parse(R"({"tool": {"name": "f", "arguments": {"z": 1, "a": 2}}})");
  auto r = render("{{ tool | tojson }}|{% for k in tool.arguments %}{{ k }}{% endfor %}", ctx);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, R"({"name": "f", "arguments": {"z": 1, "a": 2}}|za)");
  // nlohmann::json sorts its keys; the template sees them in that order.
  auto t = ChatTemplate::parse("{{ d | tojson }}");
  ASSERT_TRUE(t.ok());
  auto sorted = t->render(nlohmann::json::parse(R"({"d": {"z": 1, "a": 2}})"));
  ASSERT_TRUE(sorted.ok());
  EXPECT_EQ(*sorted, R"({"a": 2, "z": 1})");
}

TEST(ChatTemplateLanguage, SelfReferencingNamespaceRendersAndIsFreed) {
  auto r = render("{% set ns = namespace() %}{% set ns.self = ns %}{{ ns }}");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, "<Namespace {'self': <Namespace {...}>}>");
}

TEST(ChatTemplateLimits, RunawayLoopsStopCleanly) {
  ChatTemplateLimits limits;
  limits.max_steps = 100000;
  auto r = render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                  ordered_json::object(), limits);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
}

TEST(ChatTemplateLimits, UnboundedRecursionStopsCleanly) {
  auto r = render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().to_string();
  auto loop = render("{% for x in t recursive %}{{ loop(t) }}{% endfor %}",
                     ordered_json::parse(R"({"t": [1]})"));
  ASSERT_FALSE(loop.ok());
  EXPECT_EQ(loop.status().code(), StatusCode::kResourceExhausted) << loop.status().to_string();
}

TEST(ChatTemplateLimits, OutputAndValueSizesAreBounded) {
  ChatTemplateLimits limits;
  limits.max_output_bytes = 1 << 20;
  const char* hostile[] = {
      "{% for i in range(100000) %}xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx{% endfor %}",
      "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
      "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
      "{{ 'x' * 1000000000000 }}",
      "{{ [1] * 1000000000000 }}",
      "{{ 'ab'.replace('', 'x' * 1000000) }}",
      "{{ 'x' | center(1000000000) }}",
  };
  for (const char* t : hostile) {
    SCOPED_TRACE(t);
    auto r = render(t, ordered_json::object(), limits);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().to_string();
  }
}

TEST(ChatTemplateLimits, DeepOrHugeSourcesAreRejectedAtParse) {
  const std::string parens = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  std::string chain = "{{ 1";
  for (int i = 0; i < 100000; ++i) chain += " + 1";
  chain += " }}";
  std::string blocks;
  for (int i = 0; i < 1000; ++i) blocks += "{% if 1 %}";
  for (int i = 0; i < 1000; ++i) blocks += "{% endif %}";
  std::string filters = "{{ x";
  for (int i = 0; i < 10000; ++i) filters += " | trim";
  filters += " }}";
  for (const std::string& t : {parens, chain, blocks, filters}) {
    auto r = ChatTemplate::parse(t);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
  }
  ChatTemplateLimits small;
  small.max_source_bytes = 10;
  EXPECT_FALSE(ChatTemplate::parse("{{ 'more than ten bytes' }}", small).ok());
}

TEST(ChatTemplateLimits, DeepInputIsRejected) {
  std::string deep;
  for (int i = 0; i < 1000; ++i) deep += "[";
  for (int i = 0; i < 1000; ++i) deep += "]";
  auto r = render("{{ x }}", ordered_json{{"x", ordered_json::parse(deep)}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST(ChatTemplateApply, BuildsTransformersVariables) {
  auto t = ChatTemplate::parse(
      "{{ bos_token }}|{{ eos_token is defined }}|{{ tools is none }}|{{ documents is none }}|"
      "{{ add_generation_prompt }}|{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}|"
      "{{ enable_thinking }}|{{ strftime_now('%d %b %Y') }}");
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ChatTemplateInputs in;
  in.messages = ordered_json::parse(R"([
      {"role": "system", "content": "S"},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
      {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])");
  in.bos_token = "<s>";
  in.extra = ordered_json{{"enable_thinking", false}};
  in.now = fixed_now();
  auto r = t->apply(in);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r,
            "<s>|False|True|True|True|system=S;user=a\nb;"
            "user=[{'type': 'image_url', 'image_url': {'url': 'x'}}];|False|26 Jul 2024");
}

TEST(ChatTemplateApply, RealClockFormatsTheCurrentYear) {
  auto t = ChatTemplate::parse("{{ strftime_now('%Y') }}");
  ASSERT_TRUE(t.ok());
  auto r = t->apply(ChatTemplateInputs{});
  ASSERT_TRUE(r.ok());
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  EXPECT_EQ(*r, std::to_string(tm.tm_year + 1900));
}

TEST(ChatTemplateFallback, RendersRolePrefixedTurns) {
  ChatTemplateInputs in;
  in.messages = ordered_json::parse(R"([
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
      {"role": "assistant", "content": null},
      {"role": "user", "content": "Bye"}])");
  auto r = fallback_chat_template().apply(in);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, "system: Be brief.\n\nuser: Hi\n\nassistant: \n\nuser: Bye\n\nassistant:");
  in.add_generation_prompt = false;
  in.messages = ordered_json::parse(R"([{"role": "user", "content": "Hi"}])");
  r = fallback_chat_template().apply(in);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, "user: Hi\n\n");

  auto chosen = chat_template_or_fallback("");
  ASSERT_TRUE(chosen.ok());
  EXPECT_EQ(chosen->source(), kFallbackChatTemplate);
  chosen = chat_template_or_fallback("{{ 1 }}");
  ASSERT_TRUE(chosen.ok());
  EXPECT_EQ(chosen->source(), "{{ 1 }}");
}

TEST(ChatTemplateApply, ConcurrentRendersShareOneTemplate) {
  auto t = ChatTemplate::parse(
      "{% for m in messages %}{{ loop.index }}:{{ m.content | upper }}{% endfor %}");
  ASSERT_TRUE(t.ok());
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int i = 0; i < 200; ++i) {
        ChatTemplateInputs in;
        in.messages = ordered_json::array({{{"role", "user"}, {"content", "t" + std::to_string(k)}},
                                           {{"role", "user"}, {"content", std::to_string(i)}}});
        auto r = t->apply(in);
        if (!r.ok() || *r != "1:T" + std::to_string(k) + "2:" + std::to_string(i)) ++mismatches[k];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int m : mismatches) EXPECT_EQ(m, 0);
}

TEST(ChatTemplateTime, ParsesIsoDateTimes) {
  auto t = parse_chat_template_time("2024-07-26T12:00:00");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->tm_wday, 5);  // a Friday
  EXPECT_EQ(t->tm_yday, 207);
  EXPECT_TRUE(parse_chat_template_time("2024-07-26").ok());
  EXPECT_FALSE(parse_chat_template_time("yesterday").ok());
  EXPECT_FALSE(parse_chat_template_time("2024-13-01T00:00:00").ok());
}

// ../shared/chat-templates: NAME.jinja + NAME.cases.json, each case's expected text or error.
TEST(ChatTemplateSuite, EverySharedCaseMatches) {
  const fs::path dir = fs::path(CLEAVE_SOURCE_DIR) / ".." / "shared" / "chat-templates";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) GTEST_SKIP() << "no chat-template suite at " << dir;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.size() > 11 && name.compare(name.size() - 11, 11, ".cases.json") == 0) {
      files.push_back(e.path());
    }
  }
  if (files.empty()) GTEST_SKIP() << "no *.cases.json in " << dir;
  auto slurp = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  size_t checked = 0;
  for (const fs::path& f : files) {
    SCOPED_TRACE(f.filename().string());
    const ordered_json spec = ordered_json::parse(slurp(f));
    auto tmpl = ChatTemplate::parse(slurp(dir / spec["template"].get<std::string>()));
    ASSERT_TRUE(tmpl.ok()) << tmpl.status().to_string();
    auto now = parse_chat_template_time(spec.value("strftime_now_fixed", "2024-07-26T12:00:00"));
    ASSERT_TRUE(now.ok());
    int index = 0;
    for (const ordered_json& c : spec["cases"]) {
      SCOPED_TRACE("case " + std::to_string(index++));
      ordered_json context = {{"tools", nullptr}, {"documents", nullptr}, {"add_generation_prompt", false}};
      for (auto it = c.begin(); it != c.end(); ++it) {
        if (it.key() != "expected" && it.key() != "expected_error") context[it.key()] = it.value();
      }
      auto r = tmpl->render(context, *now);
      if (c.contains("expected_error")) {
        ASSERT_FALSE(r.ok()) << "rendered: " << *r;
        EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
        EXPECT_EQ(r.status().message(), c["expected_error"].get<std::string>());
      } else {
        ASSERT_TRUE(r.ok()) << r.status().to_string();
        EXPECT_EQ(*r, c["expected"].get<std::string>());
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, files.size());
}

}  // namespace
}  // namespace cleave
