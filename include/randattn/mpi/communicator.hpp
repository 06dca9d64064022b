#pragma once
// The MPI layer's view of a communicator: rank, size, the bytes this rank has handed to MPI for
// other ranks, typed wrappers of the calls the distributed methods use, and collective error
// handling. Opt-in: not included by <randattn/randattn.hpp>; link randattn::mpi.
//
// Collective errors. Every distributed entry point runs its rank-local work (validation, local
// kernels) inside Communicator::agree(): a rank whose work throws does not leave the others
// waiting in the next collective. agree() ends with one MPI_Allreduce of a failure flag; if any
// rank failed, the message of the lowest failing rank is broadcast and EVERY rank throws
// randattn::invalid_argument (a std::invalid_argument) with that same message, before any rank
// writes output; whatever the local exception was, the collective error has that one type. A
// rank never hangs on another's error. A failing MPI call itself is not an argument error: it
// throws std::runtime_error ("<call> failed: <MPI error string>").
//
// Bytes sent. bytes_sent() counts what this rank hands to MPI for other ranks: the payload of
// point-to-point messages and of all-to-all exchanges (to ranks other than itself), and for the
// reductions, scans and gathers this rank's contribution once. It is the message volume of the
// algorithm (the cost model of the README), independent of how MPI implements a collective.

#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/invalid_argument.hpp"
#include "../core/types.hpp"
#include "../detail/validation.hpp"

namespace randattn::mpi {

// The MPI datatype of a value type (float, double, the fixed-width integers, char).
template <typename T>
MPI_Datatype datatype() {
  if constexpr (std::is_same_v<T, float>)
    return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>)
    return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, std::uint64_t>)
    return MPI_UINT64_T;
  else if constexpr (std::is_same_v<T, char>)
    return MPI_CHAR;
  else
    static_assert(sizeof(T) == 0, "no MPI datatype for this type");
}

namespace detail {

inline void check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    throw std::runtime_error(std::string(call) + " failed: " + std::string(text, std::size_t(len)));
  }
}

inline int to_count(std::size_t n, const char* where) {
  randattn::detail::require(n <= std::size_t(INT32_MAX), where, "message of ", n,
                            " elements exceeds MPI's int count");
  return static_cast<int>(n);
}

// FNV-1a over the bytes of a block of values: fingerprints of objects every rank must hold
// identically (feature maps, hashes).
template <typename T>
std::uint64_t fnv1a(const T* data, std::size_t count, std::uint64_t h = 0xcbf29ce484222325ull) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < count * sizeof(T); ++i) h = (h ^ bytes[i]) * 0x100000001b3ull;
  return h;
}

}  // namespace detail

class Communicator {
 public:
  // A view of `comm` (not owned; it must outlive this object).
  explicit Communicator(MPI_Comm comm = MPI_COMM_WORLD) : comm_(comm) {
    detail::check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    detail::check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }

  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  std::uint64_t bytes_sent() const { return bytes_sent_; }
  void reset_bytes_sent() { bytes_sent_ = 0; }

  // Runs fn() on every rank and makes its failure a collective decision (see the header).
  template <typename Fn>
  void agree(Fn&& fn) {
    std::string message;
    int failed = 0;
    try {
      fn();
    } catch (const std::exception& e) {
      message = e.what();
      failed = 1;
    } catch (...) {
      message = "unknown error";
      failed = 1;
    }
    int first = failed ? rank_ : size_;
    detail::check(MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, comm_), "MPI_Allreduce");
    if (first == size_) return;
    std::uint64_t len = message.size();
    detail::check(MPI_Bcast(&len, 1, MPI_UINT64_T, first, comm_), "MPI_Bcast");
    message.resize(std::size_t(len));
    detail::check(MPI_Bcast(message.data(), detail::to_count(message.size(), "agree"), MPI_CHAR,
                            first, comm_),
                  "MPI_Bcast");
    throw randattn::invalid_argument(message);
  }

  // Throws the same randattn::invalid_argument on every rank when `ok` is false on any rank; the
  // message is that of the lowest rank where it is false.
  void require_all(bool ok, const std::string& message) {
    agree([&] {
      if (!ok) throw randattn::invalid_argument(message);
    });
  }

  // Elementwise reduction of `data` (count values) over all ranks, in place.
  template <typename T>
  void allreduce(T* data, std::size_t count, MPI_Op op) {
    bytes_sent_ += count * sizeof(T);
    detail::check(MPI_Allreduce(MPI_IN_PLACE, data, detail::to_count(count, "allreduce"),
                                datatype<T>(), op, comm_),
                  "MPI_Allreduce");
  }

  // Every rank's `mine` (any length), concatenated in rank order on every rank.
  template <typename T>
  std::vector<T> allgatherv(const std::vector<T>& mine) {
    int count = detail::to_count(mine.size(), "allgatherv");
    std::vector<int> counts(static_cast<std::size_t>(size_)),
        displs(static_cast<std::size_t>(size_));
    detail::check(MPI_Allgather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, comm_),
                  "MPI_Allgather");
    std::size_t total = 0;
    for (int r = 0; r < size_; ++r) {
      displs[std::size_t(r)] = detail::to_count(total, "allgatherv");
      total += std::size_t(counts[std::size_t(r)]);
    }
    std::vector<T> all(total);
    bytes_sent_ += mine.size() * sizeof(T);
    detail::check(MPI_Allgatherv(mine.data(), count, datatype<T>(), all.data(), counts.data(),
                                 displs.data(), datatype<T>(), comm_),
                  "MPI_Allgatherv");
    return all;
  }

  // All-to-all exchange: send[r] goes to rank r; returns what each rank sent here, in rank order
  // (received[r] from rank r).
  template <typename T>
  std::vector<std::vector<T>> alltoallv(const std::vector<std::vector<T>>& send) {
    const auto p = std::size_t(size_);
    std::vector<int> scount(p), rcount(p), sdispl(p), rdispl(p);
    std::vector<T> sbuf;
    for (std::size_t r = 0; r < p; ++r) {
      sdispl[r] = detail::to_count(sbuf.size(), "alltoallv");
      scount[r] = detail::to_count(send[r].size(), "alltoallv");
      sbuf.insert(sbuf.end(), send[r].begin(), send[r].end());
      if (int(r) != rank_) bytes_sent_ += send[r].size() * sizeof(T);
    }
    detail::check(MPI_Alltoall(scount.data(), 1, MPI_INT, rcount.data(), 1, MPI_INT, comm_),
                  "MPI_Alltoall");
    std::size_t total = 0;
    for (std::size_t r = 0; r < p; ++r) {
      rdispl[r] = detail::to_count(total, "alltoallv");
      total += std::size_t(rcount[r]);
    }
    std::vector<T> rbuf(total);
    detail::check(MPI_Alltoallv(sbuf.data(), scount.data(), sdispl.data(), datatype<T>(),
                                rbuf.data(), rcount.data(), rdispl.data(), datatype<T>(), comm_),
                  "MPI_Alltoallv");
    std::vector<std::vector<T>> received(p);
    for (std::size_t r = 0; r < p; ++r)
      received[r].assign(rbuf.begin() + rdispl[r], rbuf.begin() + rdispl[r] + rcount[r]);
    return received;
  }

  // Non-blocking point-to-point transfers (counted when posted).
  template <typename T>
  MPI_Request isend(const T* data, std::size_t count, int to, int tag) {
    MPI_Request req;
    bytes_sent_ += count * sizeof(T);
    detail::check(
        MPI_Isend(data, detail::to_count(count, "isend"), datatype<T>(), to, tag, comm_, &req),
        "MPI_Isend");
    return req;
  }
  template <typename T>
  MPI_Request irecv(T* data, std::size_t count, int from, int tag) {
    MPI_Request req;
    detail::check(
        MPI_Irecv(data, detail::to_count(count, "irecv"), datatype<T>(), from, tag, comm_, &req),
        "MPI_Irecv");
    return req;
  }
  static void wait_all(std::vector<MPI_Request>& reqs) {
    detail::check(MPI_Waitall(int(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
    reqs.clear();
  }

  // Contribution counted by the callers of raw collectives with user-defined operations.
  void count_bytes(std::uint64_t bytes) { bytes_sent_ += bytes; }

 private:
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::uint64_t bytes_sent_ = 0;
};

}  // namespace randattn::mpi
