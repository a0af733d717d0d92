// `cemlm serve`'s --tls-cert and --tls-key: read and checked at start, then, with
// --tls-reload-interval, read again for a replacement (a renewed certificate, a rotated
// Kubernetes Secret), which gRPC's file watcher serves to new connections from a copy in memory
// (served_cert_path, served_key_path): gRPC read the files themselves, and an empty one (a file
// being copied over, truncated first) ended the process on an assertion in its TLS code. Each
// change is logged with what new connections get, and a served certificate nearing or past its
// end.
#pragma once
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace cemlm::cli {

struct TlsFiles {
  std::string cert_path, key_path;
  std::string cert_pem, key_pem;
};

// Both files read and checked as a TLS server needs them: a PEM certificate chain whose first
// certificate is valid now, and the unencrypted PEM private key of that certificate. Errors
// name the flag and the file and say what to do.
absl::StatusOr<TlsFiles> read_tls_files(const std::string& cert_path, const std::string& key_path);

class TlsFileWatch {
 public:
  // `served`: the pair the server started with (read_tls_files's); `interval_s`: how often gRPC
  // reads the files again (said in the log lines), 0 for never. Warns now if the certificate
  // ends within a week. `report_end` is told the end (notAfter, Unix seconds) of the certificate
  // new connections get, now and at each look; 0 while the files cannot serve or the certificate
  // is not valid yet.
  TlsFileWatch(TlsFiles served, unsigned interval_s, std::function<void(double)> report_end);
  ~TlsFileWatch();
  TlsFileWatch(const TlsFileWatch&) = delete;
  TlsFileWatch& operator=(const TlsFileWatch&) = delete;
  // The copies gRPC's file watcher reads ("/proc/self/fd/N", memory files): what the files held
  // at the last look that read both, neither empty.
  std::string served_cert_path() const;
  std::string served_key_path() const;
  // Whether the copies could be made at the start (memory files; a process out of descriptors).
  const absl::Status& started() const { return start_; }
  // Reads the files again. When they differ from the last look, logs the new pair (its
  // certificate's subject and end) or why it cannot serve; when they cannot be read, that gRPC
  // keeps what it had. Each look also logs, once each, a served certificate that becomes valid,
  // comes within a week of its end, or passes it.
  void poll();

 private:
  absl::Status read(TlsFiles* now) const;
  void check_dates();
  absl::Status publish();  // seen_ into the copies

  TlsFiles seen_;           // the files' contents at the last look (what gRPC serves)
  std::string error_;       // why seen_ cannot serve ("" when it can)
  std::string read_error_;  // why the last look could not read the files ("" when it could)
  unsigned interval_s_;
  std::function<void(double)> report_end_;
  int dates_ = -1;  // the Dates (tls_files.cc) last said of seen_'s certificate; -1: none yet
  int cert_fd_ = -1, key_fd_ = -1;  // the copies: memory files, replaced whole by dup3
  absl::Status start_;
};

}  // namespace cemlm::cli
