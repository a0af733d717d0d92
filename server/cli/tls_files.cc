#include "tls_files.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cemlm/engine/status.h"

namespace cemlm::cli {
namespace {

using BioPtr = std::unique_ptr<BIO, decltype(&BIO_free)>;
using X509Ptr = std::unique_ptr<X509, decltype(&X509_free)>;
using KeyPtr = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;

absl::StatusOr<std::string> read_whole(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  if (in) ss << in.rdbuf();
  if (!in || in.bad())
    return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  return ss.str();
}

BioPtr pem_bio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), int(pem.size())), &BIO_free);
}

// No passphrase callback: OpenSSL's default would prompt on the terminal (for an encrypted key,
// or a certificate block with an encryption header), and block the server's signal loop.
int no_passphrase(char*, int, int, void*) { return -1; }

// The certificates of a chain, the server's own first; empty when OpenSSL can read none.
std::vector<X509Ptr> certificates(const std::string& pem) {
  std::vector<X509Ptr> chain;
  BioPtr bio = pem_bio(pem);
  while (bio) {
    X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, no_passphrase, nullptr), &X509_free);
    if (!cert) break;
    chain.push_back(std::move(cert));
  }
  ERR_clear_error();
  return chain;
}

X509Ptr first_certificate(const std::string& pem) {
  std::vector<X509Ptr> chain = certificates(pem);
  return chain.empty() ? X509Ptr(nullptr, &X509_free) : std::move(chain.front());
}

std::string text_of(const ASN1_TIME* t) {
  BioPtr out(BIO_new(BIO_s_mem()), &BIO_free);
  char* text = nullptr;
  if (!out || ASN1_TIME_print(out.get(), t) != 1) return "?";
  const long n = BIO_get_mem_data(out.get(), &text);
  return std::string(text, size_t(n));
}

double unix_seconds(const ASN1_TIME* t) {
  std::tm tm{};
  return ASN1_TIME_to_tm(t, &tm) == 1 ? double(timegm(&tm)) : 0.0;
}

std::string subject_of(const X509* cert) {
  BioPtr out(BIO_new(BIO_s_mem()), &BIO_free);
  char* text = nullptr;
  if (!out || X509_NAME_print_ex(out.get(), X509_get_subject_name(cert), 0, XN_FLAG_RFC2253) < 0)
    return "?";
  const long n = BIO_get_mem_data(out.get(), &text);
  return n > 0 ? std::string(text, size_t(n)) : "(no subject)";
}

// Every reason the pair cannot serve at all, in the order a person would fix them (its dates
// are dates_error's).
absl::Status check_pair(const TlsFiles& t) {
  // gRPC only logs a file it cannot use, and then fails to listen (or, watching the files,
  // fails every handshake): said here by name instead.
  if (t.cert_pem.find("-----BEGIN CERTIFICATE-----") == std::string::npos)
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert '", t.cert_path,
                     "' holds no PEM certificate (no '-----BEGIN CERTIFICATE-----' line): give "
                     "the server's certificate chain in PEM"));
  if (t.key_pem.find("-----BEGIN ") == std::string::npos ||
      t.key_pem.find("PRIVATE KEY-----") == std::string::npos)
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key '", t.key_path,
                     "' holds no PEM private key (no '-----BEGIN … PRIVATE KEY-----' line): give "
                     "the key of --tls-cert in PEM"));
  // PKCS#8 ("ENCRYPTED PRIVATE KEY") or OpenSSL's traditional form ("Proc-Type: 4,ENCRYPTED"):
  // gRPC said only "Invalid private key".
  if (t.key_pem.find("ENCRYPTED") != std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-key '", t.key_path,
        "' is encrypted (protected by a passphrase), which the server cannot ask for: give it "
        "the key unencrypted (openssl pkey -in KEY -out PLAIN.pem), readable by its user only"));
  const std::vector<X509Ptr> chain = certificates(t.cert_pem);
  if (chain.empty())
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert '", t.cert_path,
                     "' holds a PEM block OpenSSL cannot read as a certificate (truncated or "
                     "damaged?): give the server's certificate chain in PEM"));
  BioPtr bio = pem_bio(t.key_pem);
  KeyPtr key(bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, no_passphrase, nullptr) : nullptr,
             &EVP_PKEY_free);
  ERR_clear_error();
  if (!key)
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key '", t.key_path,
                     "' holds a PEM block OpenSSL cannot read as a private key (truncated or "
                     "damaged?): give the key of --tls-cert in PEM"));
  size_t match = 0;
  while (match < chain.size() && X509_check_private_key(chain[match].get(), key.get()) != 1)
    ++match;
  ERR_clear_error();
  if (match > 0 && match < chain.size())
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert '", t.cert_path, "' holds the certificate of --tls-key '",
                     t.key_path, "' in place ", match + 1,
                     " of its chain: put the server's own certificate first, then "
                     "the intermediates that signed it"));
  if (match > 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-cert and --tls-key are not a valid certificate chain and its private key: the "
        "key in '",
        t.key_path, "' is not the one of the certificate in '", t.cert_path,
        "' (give the two files of one pair)"));
  return absl::OkStatus();
}

enum class Dates { kNotYet, kValid, kWithinAWeek, kEnded };

Dates dates_of(const X509* cert) {
  if (X509_cmp_current_time(X509_get0_notBefore(cert)) > 0) return Dates::kNotYet;
  if (X509_cmp_current_time(X509_get0_notAfter(cert)) < 0) return Dates::kEnded;
  time_t in_a_week = std::time(nullptr) + 7 * 24 * 3600;
  return X509_cmp_time(X509_get0_notAfter(cert), &in_a_week) < 0 ? Dates::kWithinAWeek
                                                                 : Dates::kValid;
}

}  // namespace

absl::StatusOr<TlsFiles> read_tls_files(const std::string& cert_path, const std::string& key_path) {
  TlsFiles t{cert_path, key_path, "", ""};
  auto cert = read_whole(cert_path, "--tls-cert");
  if (!cert.ok()) return cert.status();
  auto key = read_whole(key_path, "--tls-key");
  if (!key.ok()) return key.status();
  t.cert_pem = *std::move(cert);
  t.key_pem = *std::move(key);
  if (absl::Status st = check_pair(t); !st.ok()) return st;
  // Every TLS client would refuse it, while health said SERVING.
  const X509Ptr c = first_certificate(t.cert_pem);
  switch (dates_of(c.get())) {
    case Dates::kEnded:
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls-cert '", cert_path, "' expired on ", text_of(X509_get0_notAfter(c.get())),
          ": every TLS client would refuse it; renew the certificate"));
    case Dates::kNotYet:
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls-cert '", cert_path, "' is not valid until ", text_of(X509_get0_notBefore(c.get())),
          ": every TLS client would refuse it until then (or this machine's clock is behind)"));
    default:
      return t;
  }
}

TlsFileWatch::TlsFileWatch(TlsFiles served, unsigned interval_s,
                           std::function<void(double)> report_end)
    : seen_(std::move(served)), interval_s_(interval_s), report_end_(std::move(report_end)) {
  start_ = publish();
  check_dates();
}

TlsFileWatch::~TlsFileWatch() {
  for (int fd : {cert_fd_, key_fd_})
    if (fd >= 0) ::close(fd);
}

std::string TlsFileWatch::served_cert_path() const {
  return absl::StrCat("/proc/self/fd/", cert_fd_);
}
std::string TlsFileWatch::served_key_path() const {
  return absl::StrCat("/proc/self/fd/", key_fd_);
}

namespace {

// A memory file holding `bytes`, put in place of `*fd` in one step (dup3), so that a reader of
// "/proc/self/fd/N" gets the old bytes or the new ones.
absl::Status replace_memory_file(int* fd, const std::string& bytes) {
  const int made = ::memfd_create("cemlm-tls", MFD_CLOEXEC);
  if (made < 0)
    return absl::InternalError(absl::StrCat(
        "TLS: cannot make a memory file for the copy gRPC reads: ", std::strerror(errno)));
  for (size_t at = 0; at < bytes.size();) {
    const ssize_t n = ::write(made, bytes.data() + at, bytes.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = errno;
      ::close(made);
      return absl::InternalError(
          absl::StrCat("TLS: cannot write the copy gRPC reads: ", std::strerror(e)));
    }
    at += size_t(n);
  }
  if (*fd < 0) {
    *fd = made;
    return absl::OkStatus();
  }
  const bool replaced = ::dup3(made, *fd, O_CLOEXEC) == *fd;
  const int e = errno;
  ::close(made);
  if (!replaced)
    return absl::InternalError(
        absl::StrCat("TLS: cannot replace the copy gRPC reads: ", std::strerror(e)));
  return absl::OkStatus();
}

}  // namespace

absl::Status TlsFileWatch::publish() {
  CEMLM_RETURN_IF_ERROR(replace_memory_file(&cert_fd_, seen_.cert_pem));
  return replace_memory_file(&key_fd_, seen_.key_pem);
}

absl::Status TlsFileWatch::read(TlsFiles* now) const {
  auto cert = read_whole(now->cert_path, "--tls-cert");
  if (!cert.ok()) return cert.status();
  auto key = read_whole(now->key_path, "--tls-key");
  if (!key.ok()) return key.status();
  now->cert_pem = *std::move(cert);
  now->key_pem = *std::move(key);
  return absl::OkStatus();
}

void TlsFileWatch::poll() {
  TlsFiles now{seen_.cert_path, seen_.key_path, "", ""};
  absl::Status st = read(&now);
  // An empty file is one being written (cp truncates first) or emptied: never a pair to serve.
  if (st.ok() && (now.cert_pem.empty() || now.key_pem.empty()))
    st = absl::FailedPreconditionError(
        absl::StrCat(now.cert_pem.empty() ? "--tls-cert '" : "--tls-key '",
                     now.cert_pem.empty() ? now.cert_path : now.key_path, "' is empty"));
  if (!st.ok()) {
    // gRPC keeps what it read last until the files can be read again: nothing changes.
    if (std::string(st.message()) != read_error_)
      spdlog::warn("TLS: {} (now); new connections go on getting what the files held before",
                   std::string(st.message()));
    read_error_ = std::string(st.message());
    return;
  }
  read_error_.clear();
  if (now.cert_pem == seen_.cert_pem && now.key_pem == seen_.key_pem) {
    if (error_.empty()) check_dates();
    return;
  }
  st = check_pair(now);
  if (!st.ok()) {
    // The two files are read one after the other: a rotation landing between the reads pairs
    // one's new file with the other's old one. A second read settles it.
    TlsFiles again{now.cert_path, now.key_path, "", ""};
    if (read(&again).ok() && !again.cert_pem.empty() && !again.key_pem.empty() &&
        (again.cert_pem != now.cert_pem || again.key_pem != now.key_pem)) {
      now = std::move(again);
      if (now.cert_pem == seen_.cert_pem && now.key_pem == seen_.key_pem) return;
      st = check_pair(now);
    }
  }
  seen_ = std::move(now);
  dates_ = -1;
  // What gRPC serves from now on (within its next read, a second): a pair that cannot serve as
  // well, which fails new connections as the files themselves did.
  if (absl::Status published = publish(); !published.ok())
    spdlog::error("{}; new connections go on getting what the files held before",
                  std::string(published.message()));
  if (!st.ok()) {
    report_end_(0);
    // Once per distinct problem, not at every look.
    if (std::string(st.message()) != error_)
      spdlog::error(
          "TLS: the files changed: {}; new TLS connections fail until they hold a valid pair "
          "(read again every {} s; connections already open go on)",
          std::string(st.message()), interval_s_);
    error_ = std::string(st.message());
    return;
  }
  error_.clear();
  const X509Ptr c = first_certificate(seen_.cert_pem);
  spdlog::info(
      "TLS: --tls-cert '{}' and --tls-key changed: connections made from now on get the "
      "certificate of {}, valid until {} (the files are read every {} s)",
      seen_.cert_path, subject_of(c.get()), text_of(X509_get0_notAfter(c.get())), interval_s_);
  check_dates();
}

void TlsFileWatch::check_dates() {
  const X509Ptr cert = first_certificate(seen_.cert_pem);
  if (!cert) return;
  const Dates d = dates_of(cert.get());
  // Clients refuse a certificate before its start as after its end.
  report_end_(d == Dates::kNotYet ? 0 : unix_seconds(X509_get0_notAfter(cert.get())));
  if (int(d) == dates_) return;  // said already
  const bool first_look = dates_ < 0;
  dates_ = int(d);
  const std::string again =
      interval_s_ > 0
          ? absl::StrCat("the server reads the files again every ", interval_s_,
                         " s, no restart needed")
          : std::string("and restart: --tls-reload-interval 0 reads the files at start only");
  switch (d) {
    case Dates::kNotYet:
      spdlog::error(
          "--tls-cert '{}' is not valid until {}: TLS clients refuse the server until then (or "
          "this machine's clock is behind)",
          seen_.cert_path, text_of(X509_get0_notBefore(cert.get())));
      break;
    case Dates::kValid:
      if (!first_look) spdlog::info("--tls-cert '{}' is valid now", seen_.cert_path);
      break;
    case Dates::kWithinAWeek:
      spdlog::warn("--tls-cert '{}' expires on {}: renew it ({})", seen_.cert_path,
                   text_of(X509_get0_notAfter(cert.get())), again);
      break;
    case Dates::kEnded:
      spdlog::error(
          "--tls-cert '{}' expired on {}: every TLS client refuses the server; renew it ({})",
          seen_.cert_path, text_of(X509_get0_notAfter(cert.get())), again);
      break;
  }
}

}  // namespace cemlm::cli
