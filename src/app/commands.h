#pragma once
// Each subcommand registers itself on the CLI; main() only wires them together.
#include <CLI/CLI.hpp>

namespace m3::app {

void register_make_model(CLI::App& app);
void register_make_draft(CLI::App& app);
void register_generate(CLI::App& app);
void register_kernel_paths(CLI::App& app);

}  // namespace m3::app
