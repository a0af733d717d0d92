// Entry points of the `cemlm` subcommands. Each lives in the folder it belongs to (engine/,
// trainer/, server/); cli/main.cc only dispatches. argv excludes the program and subcommand.
#pragma once

namespace cemlm::cli {

int cmd_init(int argc, char** argv);       // engine/cli/init.cc
int cmd_score(int argc, char** argv);      // engine/cli/score.cc
int cmd_inspect(int argc, char** argv);    // engine/cli/inspect.cc
int cmd_tokenizer(int argc, char** argv);  // engine/cli/tokenizer.cc
int cmd_generate(int argc, char** argv);   // engine/cli/generate.cc
int cmd_grads(int argc, char** argv);      // trainer/cli/grads.cc
int cmd_train(int argc, char** argv);      // trainer/cli/train.cc

int cmd_serve(int argc, char** argv);        // server/cli/serve.cc
int cmd_client(int argc, char** argv);       // server/cli/client.cc
int cmd_bench_serve(int argc, char** argv);  // server/cli/bench_serve.cc

}  // namespace cemlm::cli
