// randattn-cli: command-line front end of randattn.
//
//   randattn-cli attention --method exact --q q.npy --k k.npy --v v.npy --out o.npy
//                          [--causal] [--scale s] [--threads t] [--report] [method options]
//   randattn-cli methods [--json]
//   randattn-cli sparsify --in A.npy --budget n [--scheme spa|ndt|l2|uniform] [--seed s] --out
//   Ahat.npy [--report] randattn-cli hosvd --in A.npy --ranks r1,r2,... [--budget n [--seed s]]
//   --out-prefix P [--report]
//
// Exit codes: 0 on success (and for --help), 2 on any error, reported as one line on stderr
// starting with "randattn-cli: error: ". Outputs are written atomically: on error no output file
// is created or modified.

#include <CLI/CLI.hpp>

#include <exception>
#include <iostream>
#include <string>

#include "registry_command.hpp"
#include "sketch_commands.hpp"

#ifndef RANDATTN_CLI_VERSION
#define RANDATTN_CLI_VERSION "unknown"
#endif

namespace {

int report_error(const std::string& what) {
  std::string line = what;
  for (char& c : line)
    if (c == '\n' || c == '\r') c = ' ';
  while (!line.empty() && line.back() == ' ') line.pop_back();
  if (line.empty()) line = "unknown error";
  std::cerr << "randattn-cli: error: " << line << std::endl;
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    CLI::App app{
        "randattn command-line interface: randomized and exact attention and tensor sketching on "
        ".npy files",
        "randattn-cli"};
    app.set_version_flag("--version", std::string("randattn-cli ") + RANDATTN_CLI_VERSION);
    app.require_subcommand(1);
    randattn_cli::RegistryAttentionCommand attention(app);
    randattn_cli::MethodsCommand methods(app);
    randattn_cli::SparsifyCommand sparsify(app);
    randattn_cli::HosvdCommand hosvd(app);

    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
      return report_error(e.what());
    }

    if (attention.selected()) return attention.run();
    if (methods.selected()) return methods.run();
    if (sparsify.selected()) return sparsify.run();
    if (hosvd.selected()) return hosvd.run();
    return report_error("no subcommand given (try --help)");
  } catch (const std::exception& e) {
    return report_error(e.what());
  } catch (...) {
    return report_error("unknown error");
  }
}
