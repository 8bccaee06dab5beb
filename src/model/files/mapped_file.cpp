#include "mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "fmt/format.h"

namespace cleave {

Result<MappedFile> map_file_readonly(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NotFound(fmt::format("cannot open '{}': {}", path, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgument(fmt::format("'{}' is not a regular file", path));
  }
  const size_t len = static_cast<size_t>(st.st_size);
  if (len == 0) {
    ::close(fd);
    return DataLoss(fmt::format("'{}' is empty", path));
  }
  void* p = ::mmap(nullptr, len, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return Internal(fmt::format("mmap '{}': {}", path, std::strerror(errno)));
  MappedFile m;
  m.mapping = std::shared_ptr<void>(p, [len](void* q) { ::munmap(q, len); });
  m.bytes = {static_cast<const std::byte*>(p), len};
  return m;
}

}  // namespace cleave
