// Tokenizer helpers shared by the tests: encode_ok for texts a test expects to encode, and a
// tokenizer.model that SentencePiece loads but refuses to encode some texts with.
#pragma once
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cemlm/engine/tokenizer.h"

namespace cemlm::testing_tokens {

// A text's ids; a failed expectation naming SentencePiece's reason (and no ids) when it does not
// encode.
inline std::vector<int> encode_ok(const Tokenizer& tokenizer, std::string_view text) {
  std::string error;
  std::optional<std::vector<int>> ids = tokenizer.encode(text, &error);
  EXPECT_TRUE(ids) << error;
  return ids.value_or(std::vector<int>{});
}

// A serialized ModelProto found by fuzzing: a WORD model (trainer_spec.model_type 3) with the
// pieces <unk> (UNKNOWN), <s> (CONTROL), "▁x" (CONTROL) and "a" (NORMAL), the identity normalizer
// escaping whitespace. It loads, encodes "a" to {3}, and refuses " x" ("all normalized characters
// are not consumed"), which the tokenizer once turned into an abort.
inline const std::string kRefusesSpaceX(
    "\x0a\x0e\x0a\x05<unk>\x15\x00\x00\x00\x00\x18\x02"
    "\x0a\x0c\x0a\x03<s>\x15\x00\x00\x00\x00\x18\x03"
    "\x0a\x0d\x0a\x04\xe2\x96\x81x\x15\x00\x00\x00\x00\x18\x03"
    "\x0a\x0a\x0a\x01"
    "a\x15\x00\x00\x00\x00\x18\x01"
    "\x12\x02\x18\x03"
    "\x1a\x10\x0a\x08identity\x18\x00\x20\x00\x28\x01",
    79);

}  // namespace cemlm::testing_tokens
