// `cemlm serve`'s --tls-cert and --tls-key: read and checked at start, then, with
// --tls-reload-interval, read again for a replacement (a renewed certificate, a rotated
// Kubernetes Secret) while gRPC's own file watcher serves it to new connections. Each change is
// logged with what new connections get, and a served certificate nearing or past its end.
#pragma once
#include <functional>
#include <string>

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
  // Reads the files again. When they differ from the last look, logs the new pair (its
  // certificate's subject and end) or why it cannot serve; when they cannot be read, that gRPC
  // keeps what it had. Each look also logs, once each, a served certificate that becomes valid,
  // comes within a week of its end, or passes it.
  void poll();

 private:
  absl::Status read(TlsFiles* now) const;
  void check_dates();

  TlsFiles seen_;           // the files' contents at the last look (what gRPC serves)
  std::string error_;       // why seen_ cannot serve ("" when it can)
  std::string read_error_;  // why the last look could not read the files ("" when it could)
  unsigned interval_s_;
  std::function<void(double)> report_end_;
  int dates_ = -1;  // the Dates (tls_files.cc) last said of seen_'s certificate; -1: none yet
};

}  // namespace cemlm::cli
