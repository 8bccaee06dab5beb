// PLACEHOLDER: removed once the engine has sources.
namespace cleave {}
