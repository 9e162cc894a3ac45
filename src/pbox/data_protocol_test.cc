// The data channel's wire format and its tickets, without an agent.

#include "pbox/wire/data_protocol.h"

#include <gtest/gtest.h>

#include <random>

#include "pbox/transfer_tickets.h"

namespace bragg::pbox {
namespace {

TEST(DataProtocolTest, RequestRoundTrips) {
  DataRequest req;
  req.op = DataOp::kUpload;
  req.size = (64ull << 20) + 1;
  for (size_t i = 0; i < req.ticket.size(); ++i) {
    req.ticket[i] = static_cast<uint8_t>(i * 7 + 1);
  }
  std::string wire = EncodeDataRequest(req);
  ASSERT_EQ(wire.size(), kDataRequestBytes);
  auto back = ParseDataRequest(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->op, DataOp::kUpload);
  EXPECT_EQ(back->size, req.size);
  EXPECT_EQ(back->ticket, req.ticket);
}

TEST(DataProtocolTest, HostileRequestsAreRefused) {
  DataRequest req;
  req.op = DataOp::kDownload;
  const std::string good = EncodeDataRequest(req);
  ASSERT_TRUE(ParseDataRequest(good).ok());
  EXPECT_FALSE(ParseDataRequest("").ok());
  EXPECT_FALSE(ParseDataRequest(good.substr(0, kDataRequestBytes - 1)).ok());
  EXPECT_FALSE(ParseDataRequest(good + "x").ok());
  std::string bad = good;
  bad[0] = 'X';  // magic
  EXPECT_FALSE(ParseDataRequest(bad).ok());
  bad = good;
  bad[4] = 2;  // version
  EXPECT_FALSE(ParseDataRequest(bad).ok());
  for (int op : {0, 3, 255}) {
    bad = good;
    bad[5] = static_cast<char>(op);
    EXPECT_FALSE(ParseDataRequest(bad).ok()) << op;
  }
  bad = good;
  bad[7] = 1;  // reserved
  EXPECT_FALSE(ParseDataRequest(bad).ok());
  bad = good;
  bad[8] = 1;  // a download with a size
  EXPECT_FALSE(ParseDataRequest(bad).ok());
  // Random bytes behind a valid magic never crash and are accepted only when well formed.
  std::mt19937_64 rng(7);
  for (int i = 0; i < 20000; ++i) {
    std::string junk(kDataRequestBytes, '\0');
    for (char& c : junk) {
      c = static_cast<char>(rng());
    }
    junk.replace(0, 4, "PBXD");
    auto r = ParseDataRequest(junk);
    if (r.ok()) {
      EXPECT_TRUE(r->op == DataOp::kUpload || r->op == DataOp::kDownload);
    }
  }
}

TEST(DataProtocolTest, StatusRoundTripsAndBoundsItsMessage) {
  DataStatus st;
  st.code = absl::StatusCode::kResourceExhausted;
  st.bytes = 12345;
  st.mode = 0640;
  st.mtime_ns = -5;
  st.message = std::string(kMaxMessageBytes + 100, 'm');
  std::string wire = EncodeDataStatus(st);
  ASSERT_EQ(wire.size(), kDataStatusHeadBytes + kMaxMessageBytes);
  DataStatus back;
  auto len = ParseDataStatusHead(std::string_view(wire).substr(0, kDataStatusHeadBytes), &back);
  ASSERT_TRUE(len.ok()) << len.status();
  EXPECT_EQ(*len, kMaxMessageBytes);
  EXPECT_EQ(back.code, st.code);
  EXPECT_EQ(back.bytes, 12345u);
  EXPECT_EQ(back.mode, 0640u);
  EXPECT_EQ(back.mtime_ns, -5);
  std::string bad = wire.substr(0, kDataStatusHeadBytes);
  bad[32] = '\xff';  // message length beyond the bound
  EXPECT_FALSE(ParseDataStatusHead(bad, &back).ok());
  bad = wire.substr(0, kDataStatusHeadBytes);
  bad[4] = 17;  // code beyond the canonical ones
  EXPECT_FALSE(ParseDataStatusHead(bad, &back).ok());
  EXPECT_FALSE(ParseDataStatusHead(wire.substr(0, 10), &back).ok());
}

class TicketsTest : public ::testing::Test {
 protected:
  TransferTickets::Clock::time_point now_ = TransferTickets::Clock::now();
  TransferTickets tickets_{
      TransferTicketOptions{.ttl = std::chrono::milliseconds(1000), .max_outstanding = 4},
      [this] { return now_; }};

  static TransferGrant Grant(DataOp op, uint64_t size) {
    TransferGrant g;
    g.op = op;
    g.size = size;
    g.path = "/f";
    return g;
  }
};

TEST_F(TicketsTest, RedeemedOnceOnly) {
  auto t = tickets_.Issue(Grant(DataOp::kUpload, 10));
  ASSERT_TRUE(t.ok()) << t.status();
  auto g = tickets_.Redeem(*t, DataOp::kUpload);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->size, 10u);
  auto again = tickets_.Redeem(*t, DataOp::kUpload);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(TicketsTest, WrongForgedExpiredAndMisdirectedTicketsLookTheSame) {
  auto a = tickets_.Issue(Grant(DataOp::kUpload, 1));
  auto b = tickets_.Issue(Grant(DataOp::kDownload, 1));
  auto c = tickets_.Issue(Grant(DataOp::kDownload, 1));
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_NE(*a, *b);
  Ticket forged = *a;
  forged[31] ^= 1;  // the right lookup key, the wrong secret
  auto r1 = tickets_.Redeem(forged, DataOp::kUpload);
  auto r2 = tickets_.Redeem(*b, DataOp::kUpload);  // burns b
  ASSERT_FALSE(r1.ok());
  ASSERT_FALSE(r2.ok());
  EXPECT_FALSE(tickets_.Redeem(*b, DataOp::kDownload).ok());
  now_ += std::chrono::milliseconds(1001);
  auto r3 = tickets_.Redeem(*c, DataOp::kDownload);
  ASSERT_FALSE(r3.ok());
  EXPECT_EQ(r1.status(), r2.status());
  EXPECT_EQ(r1.status(), r3.status());
  // The forged attempt did not burn the real ticket, but it has expired by now.
  EXPECT_FALSE(tickets_.Redeem(*a, DataOp::kUpload).ok());
}

TEST_F(TicketsTest, OutstandingTicketsAreCappedAndExpireBySweep) {
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(tickets_.Issue(Grant(DataOp::kDownload, 1)).ok());
  }
  auto over = tickets_.Issue(Grant(DataOp::kDownload, 1));
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(tickets_.Sweep(), 0u);
  now_ += std::chrono::seconds(2);
  EXPECT_EQ(tickets_.Sweep(), 4u);
  EXPECT_EQ(tickets_.outstanding(), 0u);
  EXPECT_TRUE(tickets_.Issue(Grant(DataOp::kDownload, 1)).ok());
}

}  // namespace
}  // namespace bragg::pbox
