#pragma once
// response_format json_object / json_schema (and vLLM's guided_json): the output is one JSON
// object satisfying the schema (chat/json_schema.h); once the object closes only the end ids may
// come.
#include <memory>
#include <string_view>
#include <vector>

#include "chat/json_schema.h"
#include "server/structured_output.h"

namespace m3::server {

class JsonObjectConstraint final : public ByteConstraint {
 public:
  // schema: JsonSchema::any_object() for json_object.
  JsonObjectConstraint(std::shared_ptr<const TokenBytes> table, std::vector<int32_t> end_ids, Start start,
                       std::shared_ptr<const JsonSchema> schema = JsonSchema::any_object());

 private:
  bool feed(std::string_view bytes) override { return json_.feed(bytes); }
  bool accepting() const override { return json_.complete(); }
  bool can_continue() override { return !json_.complete(); }
  void allow(std::vector<char>& allowed) override;

  std::shared_ptr<const JsonSchema> schema_;
  SchemaPrefix json_;
};

}  // namespace m3::server
