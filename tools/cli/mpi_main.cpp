// randattn-mpi: randattn-cli's commands over MPI ranks (sequence-parallel attention, sharded
// sketching). Same subcommands and flags, run with mpirun:
//
//   mpirun -np P randattn-mpi attention --method exact|favor|...|lsh --q q.npy --k k.npy --v v.npy
//   --out o.npy
//                                       [--causal] [--layout contiguous|zigzag] [--report] ...
//   mpirun -np P randattn-mpi sparsify --in A.npy --budget n [--seed s] --out Ahat.npy [--report]
//   mpirun -np P randattn-mpi hosvd --in A.npy --ranks r1,r2,... --budget n [--seed s] --out-prefix
//   P [--report]
//
// Each rank reads only its own rows of the inputs (its token rows of every (batch, head) slice;
// for tensors its range of the flat index). With key padding, packed sequences, grouped heads or
// --exclude-self, each rank instead runs whole batch items and sequences (runs balanced by their
// pairs) and reads only those; the output is randattn-cli's bit for bit. Every rank writes its
// rows into the one output file with MPI-IO after rank 0's header; the file is written under a
// temporary name and renamed when complete.
// float16 attention inputs run the float32 method on their exact values; each rank rounds its
// output rows once, as randattn-cli rounds the whole output.
// --report prints one JSON line from rank 0, with "ranks" and "bytes_sent" (one entry per rank).
// Not distributed (an error): --compare, exact HOSVD (hosvd without --budget), sparsify schemes
// other than spa, LSH with exact buckets or separate keys (separate keys do run under a layout).
// Exit codes: 0 on success, 2 on any error on any rank: every rank exits 2, rank 0 prints one
// line "randattn-mpi: error: ..." on stderr, and no output file is created.

#include <mpi.h>

#include <CLI/CLI.hpp>

#include <randattn/mpi/sparsify.hpp>

#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "registry_command.hpp"
#include "sharded_methods.hpp"
#include "sketch_commands.hpp"

#ifndef RANDATTN_CLI_VERSION
#define RANDATTN_CLI_VERSION "unknown"
#endif

namespace randattn_cli {

using randattn::mpi::Communicator;

// The MPI datatype that writes Scalar's bytes: half-precision values as their 16 bits.
template <typename Scalar>
MPI_Datatype file_datatype() {
  if constexpr (randattn::is_half_precision_v<Scalar>)
    return MPI_UINT16_T;
  else
    return randattn::mpi::datatype<Scalar>();
}

// Runs fn on every rank; a failure on any rank becomes the same CliError on every rank.
template <typename Fn>
void collectively(Communicator& comm, Fn&& fn) {
  try {
    comm.agree(fn);
  } catch (const std::invalid_argument& e) {
    throw CliError(e.what());
  }
}

// Writes one .npy file from every rank's runs (element offset, values) with MPI-IO: rank 0
// writes the header, every rank its runs; the file appears under `path` only when complete.
template <typename Scalar>
void write_npy_sharded(Communicator& comm, const std::string& path, const Shape& shape,
                       const std::vector<std::pair<std::int64_t, std::vector<Scalar>>>& runs,
                       const char* flag) {
  std::string tmp;
  collectively(comm, [&] {
    if (!randattn::io::host_is_little_endian())
      throw CliError("randattn-mpi writes on little-endian hosts only");
    if (comm.rank() != 0) return;
    try {
      randattn::io::require_replaceable(path);
    } catch (const std::exception& e) {
      throw CliError(std::string(flag) + ": " + e.what());
    }
    tmp = randattn::io::temporary_path_beside(path).string();
  });
  std::uint64_t len = tmp.size();
  MPI_Bcast(&len, 1, MPI_UINT64_T, 0, comm.get());
  tmp.resize(len);
  MPI_Bcast(tmp.data(), int(len), MPI_CHAR, 0, comm.get());
  MPI_File file;
  const int opened =
      MPI_File_open(comm.get(), tmp.c_str(), MPI_MODE_CREATE | MPI_MODE_EXCL | MPI_MODE_WRONLY,
                    MPI_INFO_NULL, &file);
  if (opened != MPI_SUCCESS)
    throw CliError(std::string(flag) + ": " + path + ": cannot create output file");
  const std::string header = randattn::io::npy_header_bytes<Scalar>(shape);
  bool ok = true;
  if (comm.rank() == 0)
    ok = MPI_File_write_at(file, 0, header.data(), int(header.size()), MPI_CHAR,
                           MPI_STATUS_IGNORE) == MPI_SUCCESS;
  constexpr std::size_t kMaxRun = std::size_t(1) << 28;  // elements per call (int counts)
  for (const auto& [offset, values] : runs) {
    for (std::size_t done = 0; ok && done < values.size(); done += kMaxRun) {
      const std::size_t n = std::min(kMaxRun, values.size() - done);
      const MPI_Offset at =
          MPI_Offset(header.size() + (std::size_t(offset) + done) * sizeof(Scalar));
      ok = MPI_File_write_at(file, at, values.data() + done, int(n),
                             file_datatype<Scalar>(), MPI_STATUS_IGNORE) == MPI_SUCCESS;
    }
  }
  ok = MPI_File_close(&file) == MPI_SUCCESS && ok;
  std::error_code ec;
  try {
    collectively(comm, [&] {
      if (!ok) throw CliError(std::string(flag) + ": " + path + ": write failed");
    });
    collectively(comm, [&] {
      if (comm.rank() == 0) {
        std::filesystem::rename(tmp, path, ec);
        if (ec)
          throw CliError(std::string(flag) + ": " + path +
                         ": cannot replace output file: " + ec.message());
      }
    });
  } catch (...) {
    if (comm.rank() == 0) std::filesystem::remove(tmp, ec);
    throw;
  }
}

// The "ranks" and "bytes_sent" fields of the report (bytes_sent gathered from every rank).
inline void add_traffic(Communicator& comm, JsonObject& json) {
  const std::vector<std::uint64_t> bytes =
      comm.allgatherv(std::vector<std::uint64_t>{comm.bytes_sent()});
  json.add("ranks", comm.size()).add("bytes_sent", Shape(bytes.begin(), bytes.end()));
}

// Wall time of a collective phase: from a barrier to the slowest rank's end.
template <typename Fn>
double timed(Communicator& comm, Fn&& fn) {
  MPI_Barrier(comm.get());
  const auto start = std::chrono::steady_clock::now();
  fn();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, comm.get());
  return seconds;
}

// randattn-cli's attention command (the registry's methods and flags), each method run by its
// sharded runner (sharded_methods.hpp).
class ShardedAttentionCommand : public RegistryAttentionCommand {
 public:
  explicit ShardedAttentionCommand(CLI::App& app) : RegistryAttentionCommand(app) {
    cmd_->add_option("--layout", layout_,
                     "Rows per rank: contiguous (default) or zigzag (exact: rank p holds chunks p "
                     "and 2P-1-p of 2P, "
                     "balancing causal work)")
        ->check(CLI::IsMember({"contiguous", "zigzag"}));
  }

  int run(Communicator& comm) {
    const auto layout = layout_ == "zigzag" ? randattn::mpi::RowLayout::zigzag
                                            : randattn::mpi::RowLayout::contiguous;
    // Everything rank-local before the first exchange (flags, headers, option files) is one
    // collective decision: a rank that fails here takes every rank with it.
    const reg::Method* chosen = nullptr;
    InputInfo q, k, v;
    reg::Call call;
    reg::Layout call_layout;
    bool pieces = false;
    collectively(comm, [&] {
      chosen = &prepare();
      if (!sharded_runners<float>().count(chosen->name()))
        throw CliError(std::string("randattn-mpi: --method ") + chosen->name() +
                       " is not distributed; run it with randattn-cli");
      if (compare_)
        throw CliError("--compare is not available in randattn-mpi (compare with randattn-cli)");
      if (layout == randattn::mpi::RowLayout::zigzag && std::string(chosen->name()) != "exact")
        throw CliError("--layout zigzag is for --method exact (the others need contiguous rows)");
      q = header("--q", q_path_);
      k = shared_qk_ ? q : header("--k", k_path_);
      v = header("--v", v_path_);
      call = make_call(*chosen, q, k, v);
      pieces = layout_given() || (k.ndim() == 4 && k.shape[1] != call.shape.heads);
      if (pieces) {
        if (layout == randattn::mpi::RowLayout::zigzag)
          throw CliError(
              "--layout zigzag shards the rows of one sequence; with key padding, packed "
              "sequences, grouped heads or --exclude-self each rank runs whole batch items and "
              "sequences");
        call_layout = make_layout(*chosen, q, k, v, call);
      }
    });
    const reg::Method& method = *chosen;
    if (pieces) return run_pieces(comm, method, call, call_layout, q, k, v);
    const randattn::BatchShape& shape = call.shape;
    const Shape out_shape = output_shape(q.ndim(), shape);
    const randattn::mpi::RowPartition q_rows(shape.n_q, comm.size(), layout),
        k_rows(shape.n_k, comm.size(), layout);
    randattn::BatchShape local = shape;
    local.n_q = q_rows.local_rows(comm.rank());
    local.n_k = k_rows.local_rows(comm.rank());

    double seconds = 0;
    reg::Report fields;
    // float16 inputs run the float32 sharded method on their exact widening, and each rank
    // rounds its output rows once (randattn-cli's rule; the float32 results of the two programs
    // differ only in the order of merged partial sums).
    const auto compute = [&](auto tag) {
      using File = decltype(tag);
      using Scalar = randattn::compute_scalar_t<File>;
      std::vector<Scalar> ql, kl, vl;
      collectively(comm, [&] {
        ql = read_rows<Scalar>("--q", q_path_, q, q_rows, comm.rank());
        if (!shared_qk_) kl = read_rows<Scalar>("--k", k_path_, k, k_rows, comm.rank());
        vl = read_rows<Scalar>("--v", v_path_, v, k_rows, comm.rank());
      });
      const std::vector<Scalar>& keys = shared_qk_ ? ql : kl;
      std::vector<Scalar> out(std::size_t(local.slices() * local.n_q * local.dv));
      const Shards shards{comm, layout, shape.n_q};
      comm.reset_bytes_sent();
      try {
        seconds = timed(comm, [&] {
          fields = sharded_runners<Scalar>().at(method.name())(shards, call, ql.data(), keys.data(),
                                                               vl.data(), out.data(), local);
        });
      } catch (const std::invalid_argument& e) {  // thrown on every rank by the distributed methods
        throw CliError(e.what());
      }
      // The output rows of each slice and segment, at their offsets in the global array.
      std::vector<std::pair<std::int64_t, std::vector<Scalar>>> runs;
      for (randattn::Index s = 0; s < local.slices(); ++s) {
        randattn::Index at = 0;
        for (const auto& seg : q_rows.segments(comm.rank())) {
          const Scalar* first = out.data() + (s * local.n_q + at) * local.dv;
          runs.emplace_back((s * shape.n_q + seg.first) * shape.dv,
                            std::vector<Scalar>(first, first + seg.count * local.dv));
          at += seg.count;
        }
      }
      if constexpr (randattn::is_half_precision_v<File>) {
        std::vector<std::pair<std::int64_t, std::vector<File>>> rounded;
        collectively(comm, [&] {
          for (const auto& [offset, values] : runs) {
            std::vector<File> half(values.size());
            randattn::round_to_half(
                values.data(), randattn::Index(values.size()), half.data(),
                "method '" + std::string(method.name()) + "', output from flat index " +
                    std::to_string(offset));
            rounded.emplace_back(offset, std::move(half));
          }
        });
        write_npy_sharded<File>(comm, out_path_, out_shape, rounded, "--out");
      } else {
        write_npy_sharded<Scalar>(comm, out_path_, out_shape, runs, "--out");
      }
    };
    for_dtype(q, compute);
    print_report(comm, method, call, q, k, v, out_shape, fields, layout_, seconds);
    return 0;
  }

 private:
  // The rows [row0, row0 + rows) of one batch item b that one rank attends: its sequences
  // [seq0, seq1) of cu_seqlens, or all of n_q without packed sequences.
  struct PieceRun {
    std::int64_t b, seq0, seq1, row0, rows;
  };

  // Every rank's runs. The units, (batch item, sequence) in order, are dealt out in contiguous
  // runs balanced by their (query, key) pairs: unit u goes to the rank whose share of the total
  // holds the middle of u's pairs.
  static std::vector<std::vector<PieceRun>> piece_runs(const randattn::BatchShape& shape,
                                                       const reg::Layout& layout, int ranks) {
    std::vector<std::int64_t> offsets = layout.cu_seqlens;
    if (offsets.empty()) offsets = {0, shape.n_q};
    const auto sequences = std::int64_t(offsets.size()) - 1;
    const auto pairs = [&](std::int64_t s) {
      const std::int64_t len = offsets[std::size_t(s + 1)] - offsets[std::size_t(s)];
      return double(len) * double(layout.cu_seqlens.empty() ? shape.n_k : len);
    };
    double total = 0;
    for (std::int64_t s = 0; s < sequences; ++s) total += double(shape.batch) * pairs(s);
    std::vector<std::vector<PieceRun>> runs(static_cast<std::size_t>(ranks));
    double before = 0;
    for (std::int64_t b = 0; b < shape.batch; ++b) {
      for (std::int64_t s = 0; s < sequences; ++s) {
        const double middle = before + 0.5 * pairs(s);
        before += pairs(s);
        const int rank = total > 0 ? std::min(ranks - 1, int(middle / total * ranks)) : 0;
        std::vector<PieceRun>& mine = runs[std::size_t(rank)];
        if (!mine.empty() && mine.back().b == b && mine.back().seq1 == s) {
          mine.back().seq1 = s + 1;
        } else {
          mine.push_back({b, s, s + 1, offsets[std::size_t(s)], 0});
        }
        mine.back().rows = offsets[std::size_t(s + 1)] - mine.back().row0;
      }
    }
    return runs;
  }

  // Calls with key padding, packed sequences, grouped heads or self-exclusion: each rank runs
  // whole pieces (piece_runs) through the registry's layout job, as randattn-cli runs them, and
  // every piece's randomness depends on the seed and the piece alone, so the output is
  // randattn-cli's bit for bit. Rows of one sequence are not split across ranks here.
  int run_pieces(Communicator& comm, const reg::Method& method, const reg::Call& call,
                 const reg::Layout& layout, const InputInfo& q, const InputInfo& k,
                 const InputInfo& v) {
    const randattn::BatchShape& shape = call.shape;
    const Shape out_shape = output_shape(q.ndim(), shape);
    const std::vector<PieceRun> mine =
        piece_runs(shape, layout, comm.size())[std::size_t(comm.rank())];
    double seconds = 0;
    reg::Report fields;
    const auto compute = [&](auto tag) {
      using Scalar = decltype(tag);
      struct Local {
        std::vector<Scalar> q, k, v, out;
      };
      std::vector<Local> local(mine.size());
      collectively(comm, [&] {
        for (std::size_t i = 0; i < mine.size(); ++i) {
          const PieceRun& r = mine[i];
          // Keys: the run's own rows under packed sequences, else every key of the batch item.
          const std::int64_t k0 = layout.cu_seqlens.empty() ? 0 : r.row0,
                             nk = layout.cu_seqlens.empty() ? shape.n_k : r.rows;
          local[i].q = read_piece<Scalar>("--q", q_path_, q, r.b, r.row0, r.rows);
          if (!shared_qk_) local[i].k = read_piece<Scalar>("--k", k_path_, k, r.b, k0, nk);
          local[i].v = read_piece<Scalar>("--v", v_path_, v, r.b, k0, nk);
          local[i].out.resize(std::size_t(shape.heads * r.rows * shape.dv));
        }
      });
      comm.reset_bytes_sent();
      seconds = timed(comm, [&] {
        collectively(comm, [&] {
          for (std::size_t i = 0; i < mine.size(); ++i) {
            const PieceRun& r = mine[i];
            reg::Call piece = call;
            piece.shape.batch = 1;
            reg::Layout piece_layout;
            piece_layout.kv_heads = layout.kv_heads;
            if (!layout.key_padding.empty()) {
              const auto first = layout.key_padding.begin() + std::ptrdiff_t(r.b * shape.n_k);
              piece_layout.key_padding.assign(first, first + std::ptrdiff_t(shape.n_k));
            }
            if (!layout.cu_seqlens.empty()) {
              piece.shape.n_q = piece.shape.n_k = r.rows;
              for (std::int64_t s = r.seq0; s <= r.seq1; ++s)
                piece_layout.cu_seqlens.push_back(layout.cu_seqlens[std::size_t(s)] - r.row0);
            }
            Local& l = local[i];
            reg::Report got = reg::build_job<Scalar>(method, piece, piece_layout)(
                l.q.data(), shared_qk_ ? nullptr : l.k.data(), l.v.data(), l.out.data());
            if (i == 0) fields = std::move(got);
          }
        });
      });
      // Each run's rows of every query head, at their offsets in the global array.
      std::vector<std::pair<std::int64_t, std::vector<Scalar>>> runs;
      for (std::size_t i = 0; i < mine.size(); ++i) {
        const PieceRun& r = mine[i];
        for (std::int64_t h = 0; h < shape.heads; ++h) {
          const Scalar* first = local[i].out.data() + h * r.rows * shape.dv;
          runs.emplace_back(((r.b * shape.heads + h) * shape.n_q + r.row0) * shape.dv,
                            std::vector<Scalar>(first, first + r.rows * shape.dv));
        }
      }
      write_npy_sharded<Scalar>(comm, out_path_, out_shape, runs, "--out");
    };
    for_dtype(q, compute);
    // The method's fields are those of rank 0's first run of pieces.
    print_report(comm, method, call, q, k, v, out_shape, fields, "pieces", seconds);
    return 0;
  }

  // compute(Scalar()) for the inputs' dtype (float, double or Eigen::half).
  template <typename Compute>
  static void for_dtype(const InputInfo& q, Compute&& compute) {
    randattn::io::with_element_type(q.dtype, compute);
  }

  // With --report, rank 0 prints the call's JSON line (every rank takes part: the traffic is
  // gathered).
  void print_report(Communicator& comm, const reg::Method& method, const reg::Call& call,
                    const InputInfo& q, const InputInfo& k, const InputInfo& v,
                    const Shape& out_shape, const reg::Report& fields, const std::string& layout,
                    double seconds) const {
    if (!report_) return;
    JsonObject json = report_json(method, call, q, k, v, out_shape, fields);
    json.add("layout", layout).add("seconds", seconds);
    add_traffic(comm, json);
    if (comm.rank() == 0) std::cout << json.str() << std::endl;
  }

  // Rows [row0, row0 + rows) of batch item b of every head of an input ((n, c), (heads, n, c) or
  // (batch, heads, n, c)), heads concatenated.
  template <typename Scalar>
  static std::vector<Scalar> read_piece(const char* flag, const std::string& path,
                                        const InputInfo& in, std::int64_t b, std::int64_t row0,
                                        std::int64_t rows) {
    const std::size_t axis = in.ndim() - 2;
    const std::int64_t n = in.shape[axis], cols = in.shape[axis + 1];
    try {
      if (in.ndim() < 4)
        return randattn::io::read_npy_block(path, axis, row0, rows).values<Scalar>();
      const std::vector<Scalar> item = randattn::io::read_npy_block(path, 0, b, 1).values<Scalar>();
      std::vector<Scalar> out;
      out.reserve(std::size_t(in.shape[1] * rows * cols));
      for (std::int64_t h = 0; h < in.shape[1]; ++h) {
        const auto first = item.begin() + std::ptrdiff_t((h * n + row0) * cols);
        out.insert(out.end(), first, first + std::ptrdiff_t(rows * cols));
      }
      return out;
    } catch (const std::exception& e) {
      throw CliError(std::string(flag) + ": " + e.what());
    }
  }

  static InputInfo header(const char* flag, const std::string& path) {
    try {
      const randattn::io::NpyHeader h = randattn::io::read_npy_header(path);
      return {h.shape, h.dtype};
    } catch (const std::exception& e) {
      throw CliError(std::string(flag) + ": " + e.what());
    }
  }

  // A block's values as Scalar: its own dtype, or float16 widened exactly to float.
  template <typename Scalar>
  static std::vector<Scalar> values_as(randattn::io::NpyArray&& block) {
    if constexpr (std::is_same_v<Scalar, float>) {
      if (block.is_float16()) {
        const std::vector<Eigen::half>& half = block.values<Eigen::half>();
        std::vector<float> out(half.size());
        randattn::widen_to_float(half.data(), randattn::Index(half.size()), out.data());
        return out;
      }
    }
    return std::move(block.values<Scalar>());
  }

  // This rank's token rows (axis ndim − 2) of every slice, segments concatenated per slice.
  template <typename Scalar>
  static std::vector<Scalar> read_rows(const char* flag, const std::string& path,
                                       const InputInfo& in, const randattn::mpi::RowPartition& rows,
                                       int rank) {
    const std::size_t axis = in.ndim() - 2;
    const std::int64_t slices = axis == 2 ? in.shape[0] * in.shape[1] : 1,
                       cols = in.shape[axis + 1];
    const auto segments = rows.segments(rank);
    std::vector<std::vector<Scalar>> blocks;
    try {
      for (const auto& seg : segments)
        blocks.push_back(
            values_as<Scalar>(randattn::io::read_npy_block(path, axis, seg.first, seg.count)));
    } catch (const std::exception& e) {
      throw CliError(std::string(flag) + ": " + e.what());
    }
    std::vector<Scalar> out;
    for (std::int64_t s = 0; s < slices; ++s)
      for (std::size_t b = 0; b < segments.size(); ++b) {
        const std::size_t len = std::size_t(segments[b].count * cols);
        out.insert(out.end(), blocks[b].begin() + std::ptrdiff_t(s * len),
                   blocks[b].begin() + std::ptrdiff_t((s + 1) * len));
      }
    return out;
  }

  std::string layout_ = "contiguous";
};

// Loads this rank's range of the flat index of --in (sketch_range) and calls
// fn(dims, local values, range).
// `setup` (the command's own flag checks) runs first, in the same collective decision.
template <typename Setup, typename Fn>
void with_local_range(Communicator& comm, const std::string& path, std::string& dtype, Shape& shape,
                      Setup&& setup, Fn&& fn) {
  randattn::io::NpyArray local;
  randattn::mpi::Segment range;
  collectively(comm, [&] {
    setup();
    randattn::io::NpyHeader h;
    try {
      h = randattn::io::read_npy_header(path);
    } catch (const std::exception& e) {
      throw CliError(std::string("--in: ") + e.what());
    }
    require_sketchable(h.shape, h.dtype);
    shape = h.shape;
    dtype = randattn::io::dtype_name(h.dtype);
    range = randattn::mpi::sketch_range(randattn::Index(h.count), comm.rank(), comm.size());
    try {
      local = randattn::io::read_npy_range(path, range.first, range.count);
    } catch (const std::exception& e) {
      throw CliError(std::string("--in: ") + e.what());
    }
  });
  const std::vector<randattn::Index> dims(shape.begin(), shape.end());
  if (local.is_float32())
    fn(dims, local.values<float>(), range);
  else
    fn(dims, local.values<double>(), range);
}

class ShardedSparsifyCommand : public SparsifyCommand {
 public:
  using SparsifyCommand::SparsifyCommand;

  int run(Communicator& comm) {
    with_local_range(comm, in_path_, dtype_, shape_,
                     [&] { options_.scheme = randattn::parse_scheme(scheme_); },
                     [&](const auto& dims, const auto& values, const auto& range) {
                       using Scalar = typename std::decay_t<decltype(values)>::value_type;
                       randattn::SparseSketch<Scalar> sketch;
                       comm.reset_bytes_sent();
                       const double seconds = timed(comm, [&] {
                         try {
                           sketch = randattn::mpi::sparsify(
                               comm, dims, values.data(), randattn::Index(values.size()), options_);
                         } catch (const std::invalid_argument& e) {
                           throw CliError(e.what());
                         }
                       });
                       std::vector<Scalar> dense(values.size(), Scalar(0));
                       for (randattn::Index e = 0; e < sketch.nnz(); ++e)
                         dense[std::size_t(sketch.indices()[std::size_t(e)] - range.first)] =
                             sketch.values()[std::size_t(e)];
                       // ||A − Â||_F² and ||A||_F² summed over ranks.
                       double sums[3] = {0, 0, double(sketch.nnz())};
                       for (std::size_t t = 0; t < values.size(); ++t) {
                         sums[0] += (double(values[t]) - double(dense[t])) *
                                    (double(values[t]) - double(dense[t]));
                         sums[1] += double(values[t]) * double(values[t]);
                       }
                       MPI_Allreduce(MPI_IN_PLACE, sums, 3, MPI_DOUBLE, MPI_SUM, comm.get());
                       JsonObject json;
                       json.add("scheme", randattn::scheme_name(options_.scheme))
                           .add("dtype", dtype_)
                           .add("shape", shape_)
                           .add("budget", options_.budget)
                           .add("seed", std::uint64_t(options_.seed))
                           .add("nnz", std::int64_t(sums[2]))
                           .add("expected_nnz", sketch.stats.expected_nnz)
                           .add("keep_threshold", sketch.stats.keep_threshold())
                           .add("uniform_threshold", sketch.stats.uniform_threshold())
                           .add("rel_fro_error", std::sqrt(sums[0] / sums[1]))
                           .add("seconds", seconds);
                       add_traffic(comm, json);
                       write_npy_sharded<Scalar>(comm, out_path_, shape_,
                                                 {{range.first, std::move(dense)}}, "--out");
                       if (report_ && comm.rank() == 0) std::cout << json.str() << std::endl;
                     });
    return 0;
  }
};

class ShardedHosvdCommand : public HosvdCommand {
 public:
  using HosvdCommand::HosvdCommand;

  int run(Communicator& comm) {
    const auto setup = [&] {
      if (budget_opt_->count() == 0)
        throw CliError(
            "randattn-mpi hosvd needs --budget (the sketched HOSVD is distributed, the exact one "
            "is not)");
    };
    with_local_range(
        comm, in_path_, dtype_, shape_, setup, [&](const auto& dims, const auto& values, const auto&) {
          using Scalar = typename std::decay_t<decltype(values)>::value_type;
          const std::vector<randattn::Index> ranks(ranks_.begin(), ranks_.end());
          randattn::SketchedHosvd<Scalar> s;
          comm.reset_bytes_sent();
          const double seconds = timed(comm, [&] {
            try {
              s = randattn::mpi::sketched_hosvd(comm, dims, values.data(),
                                                randattn::Index(values.size()), ranks, options_);
            } catch (const std::invalid_argument& e) {
              throw CliError(e.what());
            }
          });
          JsonObject json;
          json.add("method", "sketched")
              .add("dtype", dtype_)
              .add("shape", shape_)
              .add("ranks", ranks_)
              .add("budget", options_.budget)
              .add("seed", std::uint64_t(options_.seed))
              .add("nnz", Shape{s.nnz[0], s.nnz[1]})
              .add("expected_nnz", s.stats.expected_nnz)
              .add("seconds", seconds);
          add_traffic(comm, json);
          collectively(comm, [&] {
            if (comm.rank() == 0) write_factors(s.factors);
          });
          if (report_ && comm.rank() == 0) std::cout << json.str() << std::endl;
        });
    return 0;
  }
};

}  // namespace randattn_cli

namespace {

int report_error(const randattn_cli::Communicator& comm, const std::string& what) {
  if (comm.rank() == 0) {
    std::string line = what;
    for (char& c : line)
      if (c == '\n' || c == '\r') c = ' ';
    std::cerr << "randattn-mpi: error: " << (line.empty() ? "unknown error" : line) << std::endl;
  }
  return 2;
}

int run(int argc, char** argv, randattn_cli::Communicator& comm) {
  try {
    CLI::App app{"randattn over MPI: distributed attention and tensor sketching on .npy files",
                 "randattn-mpi"};
    app.set_version_flag("--version", std::string("randattn-mpi ") + RANDATTN_CLI_VERSION);
    app.require_subcommand(1);
    randattn_cli::ShardedAttentionCommand attention(app);
    randattn_cli::ShardedSparsifyCommand sparsify(app);
    randattn_cli::ShardedHosvdCommand hosvd(app);
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (e.get_exit_code() == 0) return comm.rank() == 0 ? app.exit(e) : 0;  // --help, --version
      // The other ranks may have parsed their command line: join their first collective
      // decision (every command starts with one) with this rank's failure.
      const std::string what = e.what();
      try {
        comm.agree([&] { throw randattn_cli::CliError(what); });
      } catch (const std::exception& agreed) {
        return report_error(comm, agreed.what());
      }
      return report_error(comm, what);
    }
    if (attention.selected()) return attention.run(comm);
    if (sparsify.selected()) return sparsify.run(comm);
    if (hosvd.selected()) return hosvd.run(comm);
    return report_error(comm, "no subcommand given (try --help)");
  } catch (const std::exception& e) {
    return report_error(comm, e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int code = 0;
  {
    randattn_cli::Communicator comm;
    code = run(argc, argv, comm);
    // Every rank leaves with the same code (errors are collective; this guards the rest).
    MPI_Allreduce(MPI_IN_PLACE, &code, 1, MPI_INT, MPI_MAX, comm.get());
  }
  MPI_Finalize();
  return code;
}
