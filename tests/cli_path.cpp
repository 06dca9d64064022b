// The path of the built randattn-cli, for the CLI contract tests (test_cli.cpp). A translation
// unit of its own: the absolute path is on this file's command line alone, so the suite's other
// objects compile the same in every clone (a compiler cache shares them between clones) and
// test_cli.cpp can join a unity batch.
namespace testing {
extern const char* const cli_path;
const char* const cli_path = RANDATTN_CLI_PATH;
}  // namespace testing
