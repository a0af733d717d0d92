// Entry points of the `cemlm` subcommands. Each lives in the folder it belongs to (engine/,
// trainer/, server/); cli/main.cc only dispatches. argv excludes the program and subcommand.
#pragma once

namespace cemlm::cli {

int cmd_init(int argc, char** argv);       // engine/cli/init.cc
int cmd_score(int argc, char** argv);      // engine/cli/score.cc
int cmd_inspect(int argc, char** argv);    // engine/cli/inspect.cc
int cmd_tokenizer(int argc, char** argv);  // engine/cli/tokenizer.cc

}  // namespace cemlm::cli
