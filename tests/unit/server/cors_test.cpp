// CORS: preflights and response headers under the default (any origin) and restricted policies.
#include <gtest/gtest.h>

#include <map>

#include "server/cors.h"

namespace m3::server {
namespace {

std::map<std::string, std::string> as_map(const Headers& headers) {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : headers) out[k] = v;
  return out;
}

TEST(Cors, AnyOriginByDefault) {
  const CorsPolicy any;
  auto h = as_map(cors_response_headers(any, "http://app.example"));
  EXPECT_EQ(h["Access-Control-Allow-Origin"], "*");
  EXPECT_FALSE(h.count("Access-Control-Allow-Credentials"));
  EXPECT_TRUE(cors_response_headers(any, "").empty());  // not a cross-origin request
  PreflightAnswer a = cors_preflight(any, "http://app.example", "POST", "authorization, content-type");
  EXPECT_EQ(a.status, 200);
  h = as_map(a.headers);
  EXPECT_EQ(h["Access-Control-Allow-Origin"], "*");
  EXPECT_EQ(h["Access-Control-Allow-Headers"], "authorization, content-type");  // "*" echoes what was asked
  EXPECT_NE(h["Access-Control-Allow-Methods"].find("POST"), std::string::npos);
  EXPECT_EQ(h["Access-Control-Max-Age"], "600");
}

TEST(Cors, RestrictedPolicy) {
  CorsPolicy p;
  ASSERT_FALSE(parse_cors_list("--allowed-origins", R"(["http://a.example", "http://b.example"])", p.origins));
  ASSERT_FALSE(parse_cors_list("--allowed-methods", "GET, POST", p.methods));
  ASSERT_FALSE(parse_cors_list("--allowed-headers", "Authorization", p.headers));
  p.credentials = true;
  auto h = as_map(cors_response_headers(p, "http://b.example"));
  EXPECT_EQ(h["Access-Control-Allow-Origin"], "http://b.example");  // echoed, never "*", with credentials
  EXPECT_EQ(h["Vary"], "Origin");
  EXPECT_EQ(h["Access-Control-Allow-Credentials"], "true");
  EXPECT_TRUE(cors_response_headers(p, "http://evil.example").empty());

  PreflightAnswer ok = cors_preflight(p, "http://a.example", "POST", "authorization, Content-Type");
  EXPECT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(as_map(ok.headers)["Access-Control-Allow-Methods"], "GET, POST");
  PreflightAnswer origin = cors_preflight(p, "http://evil.example", "POST", "");
  EXPECT_EQ(origin.status, 400);
  EXPECT_EQ(origin.body, "Disallowed CORS origin");
  EXPECT_FALSE(as_map(origin.headers).count("Access-Control-Allow-Origin"));
  PreflightAnswer both = cors_preflight(p, "http://evil.example", "DELETE", "x-custom");
  EXPECT_EQ(both.body, "Disallowed CORS origin, method, headers");
}

TEST(Cors, FlagValues) {
  std::vector<std::string> out;
  EXPECT_FALSE(parse_cors_list("--allowed-origins", "*", out));
  EXPECT_EQ(out, std::vector<std::string>{"*"});
  EXPECT_FALSE(parse_cors_list("--allowed-origins", " http://a , http://b ", out));
  EXPECT_EQ(out, (std::vector<std::string>{"http://a", "http://b"}));
  auto err = parse_cors_list("--allowed-origins", "[\"http://a\", 3]", out);
  ASSERT_TRUE(err);
  EXPECT_NE(err->find("--allowed-origins"), std::string::npos);
  EXPECT_TRUE(parse_cors_list("--allowed-methods", "[\"GET\"", out));
  EXPECT_TRUE(parse_cors_list("--allowed-headers", " , ", out));
}

}  // namespace
}  // namespace m3::server
