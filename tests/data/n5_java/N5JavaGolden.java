// Writes N5 blocks the way N5-Java's DefaultBlockWriter does, with the
// compression streams N5-Java uses (lz4-java's LZ4BlockOutputStream, the JDK's
// Deflater, commons-compress' gzip/bzip2/xz), for tests/test_n5_format.py.
//
// Dataset: dimensions [70, 9], blockSize [64, 4], dataType int32. Blocks
// written: grid (0, 0) (full, 64 x 4) and grid (1, 2) (edge: header 6 x 1,
// data truncated). Element (x, y) = x + 100 * y for x < 32, else
// (x * 31 + y * 17) * 0x9E3779B1 (int overflow), so LZ4 produces both
// compressed and stored (RAW) blocks.
//
// Regenerate (Debian packages liblz4-java, libcommons-compress-java, libxz-java):
//   CP=/usr/share/java/lz4-java.jar:/usr/share/java/commons-compress.jar:/usr/share/java/xz.jar
//   javac -cp $CP -d /tmp N5JavaGolden.java && java -cp /tmp:$CP N5JavaGolden .
import java.io.ByteArrayOutputStream;
import java.io.DataOutputStream;
import java.io.FileOutputStream;
import java.io.OutputStream;
import java.nio.ByteBuffer;
import java.util.zip.Deflater;
import java.util.zip.DeflaterOutputStream;

import net.jpountz.lz4.LZ4BlockOutputStream;
import org.apache.commons.compress.compressors.bzip2.BZip2CompressorOutputStream;
import org.apache.commons.compress.compressors.gzip.GzipCompressorOutputStream;
import org.apache.commons.compress.compressors.gzip.GzipParameters;
import org.apache.commons.compress.compressors.xz.XZCompressorOutputStream;

public class N5JavaGolden {
  static final int[] DIMS = {70, 9};
  static final int[] BLOCK = {64, 4};

  static int value(int x, int y) {
    return x < 32 ? x + 100 * y : (x * 31 + y * 17) * 0x9E3779B1;
  }

  static OutputStream compressor(String name, OutputStream out) throws Exception {
    switch (name) {
      case "lz4": return new LZ4BlockOutputStream(out, 64);
      case "gzip": {
        GzipParameters p = new GzipParameters();
        p.setCompressionLevel(Deflater.DEFAULT_COMPRESSION);
        return new GzipCompressorOutputStream(out, p);
      }
      case "zlib": return new DeflaterOutputStream(out, new Deflater(Deflater.DEFAULT_COMPRESSION));
      case "bzip2": return new BZip2CompressorOutputStream(out, 9);
      case "xz": return new XZCompressorOutputStream(out, 6);
      default: throw new IllegalArgumentException(name);
    }
  }

  static byte[] block(String name, int gx, int gy) throws Exception {
    int x0 = gx * BLOCK[0], y0 = gy * BLOCK[1];
    int w = Math.min(BLOCK[0], DIMS[0] - x0), h = Math.min(BLOCK[1], DIMS[1] - y0);
    ByteBuffer data = ByteBuffer.allocate(4 * w * h);  // big-endian, first dimension fastest
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x)
        data.putInt(value(x0 + x, y0 + y));
    ByteArrayOutputStream bytes = new ByteArrayOutputStream();
    DataOutputStream header = new DataOutputStream(bytes);
    header.writeShort(0);  // mode: default
    header.writeShort(2);  // number of dimensions
    header.writeInt(w);
    header.writeInt(h);
    header.flush();
    try (OutputStream c = compressor(name, bytes)) {
      c.write(data.array());
    }
    return bytes.toByteArray();
  }

  public static void main(String[] args) throws Exception {
    for (String name : new String[] {"lz4", "gzip", "zlib", "bzip2", "xz"}) {
      for (int[] g : new int[][] {{0, 0}, {1, 2}}) {
        try (FileOutputStream f = new FileOutputStream(args[0] + "/" + name + "." + g[0] + "." + g[1])) {
          f.write(block(name, g[0], g[1]));
        }
      }
    }
  }
}
