// The state lives as S[k][v] (K rows of V) inside a task: every per-token
// update is then a row-wise axpy or dot over contiguous memory, which the
// compiler vectorises. The API's V-first layout is converted at the ends.
#include "cpu/recurrence.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

namespace kda::cpu {
namespace {

template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) {
    s += a[i] * b[i];
  }
  return s;
}

template <typename T>
inline void axpy(T* __restrict y, T a, const T* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    y[i] += a * x[i];
  }
}

// state [V][K] (API layout) -> S [K][V]
template <typename T>
void load_state(const T* src, T* S, int64_t K, int64_t V) {
  for (int64_t v = 0; v < V; ++v) {
    for (int64_t k = 0; k < K; ++k) {
      S[k * V + v] = src[v * K + k];
    }
  }
}

template <typename T>
void store_state(const T* S, T* dst, int64_t K, int64_t V) {
  for (int64_t v = 0; v < V; ++v) {
    for (int64_t k = 0; k < K; ++k) {
      dst[v * K + k] = S[k * V + v];
    }
  }
}

// One token's state update in place. First pass: S <- Diag(alpha) S and the
// prediction S^T k; w = v - S^T k (the un-scaled error; v = 0 for a null vt) is kept for the
// backward. Second pass: S <- S + k (beta w)^T. If `out` is given, it also
// reads o = scale S^T q in the second pass.
template <typename T>
void step(T* __restrict S, const T* kt, const T* at, const T* vt, T bt, const T* qt, T scale, T* __restrict w,
          T* __restrict u, T* __restrict out, int64_t K, int64_t V) {
  std::fill(w, w + V, T(0));
  for (int64_t k = 0; k < K; ++k) {
    T* row = S + k * V;
    const T decay = at[k];
    const T kk = kt[k];
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) {
      row[v] *= decay;
      w[v] += kk * row[v];
    }
  }
  for (int64_t v = 0; v < V; ++v) {
    w[v] = (vt != nullptr ? vt[v] : T(0)) - w[v];
    u[v] = bt * w[v];
  }
  if (out != nullptr) {
    std::fill(out, out + V, T(0));
    for (int64_t k = 0; k < K; ++k) {
      T* row = S + k * V;
      const T kk = kt[k];
      const T qq = scale * qt[k];
#pragma omp simd
      for (int64_t v = 0; v < V; ++v) {
        row[v] += kk * u[v];
        out[v] += qq * row[v];
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      axpy(S + k * V, kt[k], u, V);
    }
  }
}

}  // namespace

template <typename T>
void recurrence_forward(const RecurrenceArgs<T>& a, T* out, T* final_state) {
  const int64_t H = a.H, K = a.K, V = a.V;
  const int64_t N = static_cast<int64_t>(a.offsets.size()) - 1;
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> S(K * V), w(V), u(V);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / H, h = task % H;
      if (a.skip != nullptr && a.skip[n]) {
        for (int64_t t = a.offsets[n]; t < a.offsets[n + 1] && out != nullptr; ++t) {
          std::fill(out + (t * H + h) * V, out + (t * H + h + 1) * V, T(0));
        }
        continue;
      }
      if (a.initial_state != nullptr) {
        load_state(a.initial_state + task * V * K, S.data(), K, V);
      } else {
        std::fill(S.begin(), S.end(), T(0));
      }
      for (int64_t t = a.offsets[n]; t < a.offsets[n + 1]; ++t) {
        const int64_t th = t * H + h;
        const T* vt = a.v != nullptr ? a.v + th * V : nullptr;
        step(S.data(), a.kn + th * K, a.alpha + th * K, vt, a.beta[th], a.qn + th * K, a.scale, w.data(), u.data(),
             out != nullptr ? out + th * V : nullptr, K, V);
        if (a.after_token) {
          a.after_token(n, h, t - a.offsets[n], S.data());
        }
      }
      if (final_state != nullptr) {
        store_state(S.data(), final_state + task * V * K, K, V);
      }
    }
  });
}

// Backward through time with checkpoints: one forward pass keeps the state at
// every chunk start, then chunks are replayed in reverse, each re-running its
// forward to hold its C + 1 states. C ~ sqrt(T) bounds memory by ~2 sqrt(T)
// states per task instead of T.
template <typename T>
void recurrence_backward(const RecurrenceArgs<T>& a, const RecurrenceGrads<T>& g) {
  const int64_t H = a.H, K = a.K, V = a.V, KV = a.K * a.V;
  const int64_t N = static_cast<int64_t>(a.offsets.size()) - 1;
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> dS(KV), u(V), du(V), dp(V), scratch(V);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / H, h = task % H;
      const int64_t t0 = a.offsets[n], t1 = a.offsets[n + 1], len = t1 - t0;
      const int64_t C = std::max<int64_t>(16, static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(len)))));
      const int64_t num_chunks = (len + C - 1) / C;

      std::vector<T> checkpoints(std::max<int64_t>(num_chunks, 1) * KV);
      std::vector<T> states((C + 1) * KV), W(C * V);
      T* S = states.data();
      if (a.initial_state != nullptr) {
        load_state(a.initial_state + task * KV, S, K, V);
      } else {
        std::fill(S, S + KV, T(0));
      }
      for (int64_t c = 0; c < num_chunks; ++c) {
        std::copy(S, S + KV, checkpoints.data() + c * KV);
        for (int64_t t = t0 + c * C; t < std::min(t1, t0 + (c + 1) * C); ++t) {
          const int64_t th = t * H + h;
          step<T>(S, a.kn + th * K, a.alpha + th * K, a.v + th * V, a.beta[th], nullptr, 0, scratch.data(), u.data(),
                  nullptr, K, V);
        }
      }

      if (g.grad_final_state != nullptr) {
        load_state(g.grad_final_state + task * KV, dS.data(), K, V);
      } else {
        std::fill(dS.begin(), dS.end(), T(0));
      }

      for (int64_t c = num_chunks - 1; c >= 0; --c) {
        const int64_t cs = t0 + c * C, ce = std::min(t1, cs + C);
        std::copy(checkpoints.data() + c * KV, checkpoints.data() + (c + 1) * KV, states.data());
        for (int64_t t = cs; t < ce; ++t) {
          const int64_t th = t * H + h, i = t - cs;
          T* next = states.data() + (i + 1) * KV;
          std::copy(states.data() + i * KV, states.data() + (i + 1) * KV, next);
          step<T>(next, a.kn + th * K, a.alpha + th * K, a.v + th * V, a.beta[th], nullptr, 0, W.data() + i * V,
                  u.data(), nullptr, K, V);
        }
        for (int64_t t = ce - 1; t >= cs; --t) {
          const int64_t th = t * H + h, i = t - cs;
          const T* S_prev = states.data() + i * KV;
          const T* S_t = states.data() + (i + 1) * KV;
          const T* w = W.data() + i * V;
          const T* qt = a.qn + th * K;
          const T* kt = a.kn + th * K;
          const T* at = a.alpha + th * K;
          const T* dout = g.grad_out + th * V;
          const T bt = a.beta[th];
          T* dq = g.dqn + th * K;
          T* dk = g.dkn + th * K;
          T* dalpha = g.dalpha + th * K;
          for (int64_t v = 0; v < V; ++v) {
            u[v] = bt * w[v];
          }
          // o = scale S_t^T q and S_t = S' + k u^T.
          std::fill(du.begin(), du.end(), T(0));
          for (int64_t k = 0; k < K; ++k) {
            T* drow = dS.data() + k * V;
            dq[k] = a.scale * dot(S_t + k * V, dout, V);
            axpy(drow, a.scale * qt[k], dout, V);
            axpy(du.data(), kt[k], drow, V);
            dk[k] = dot(drow, u.data(), V);
          }
          // u = beta (v - S'^T k).
          g.dbeta[th] = dot(du.data(), w, V);
          T* dv = g.dv + th * V;
          for (int64_t v = 0; v < V; ++v) {
            dv[v] = bt * du[v];
            dp[v] = -bt * du[v];
          }
          // S'^T k with S' = Diag(alpha) S_prev.
          for (int64_t k = 0; k < K; ++k) {
            T* drow = dS.data() + k * V;
            const T* prow = S_prev + k * V;
            dk[k] += at[k] * dot(prow, dp.data(), V);
            axpy(drow, kt[k], dp.data(), V);
            dalpha[k] = dot(drow, prow, V);
#pragma omp simd
            for (int64_t v = 0; v < V; ++v) {
              drow[v] *= at[k];
            }
          }
        }
      }
      if (g.dinitial_state != nullptr) {
        store_state(dS.data(), g.dinitial_state + task * KV, K, V);
      }
    }
  });
}

template void recurrence_forward<float>(const RecurrenceArgs<float>&, float*, float*);
template void recurrence_forward<double>(const RecurrenceArgs<double>&, double*, double*);
template void recurrence_backward<float>(const RecurrenceArgs<float>&, const RecurrenceGrads<float>&);
template void recurrence_backward<double>(const RecurrenceArgs<double>&, const RecurrenceGrads<double>&);

}  // namespace kda::cpu
